"""Per-rank bodies of the layout-search tests: the layout the planner chooses trains like one process."""

from __future__ import annotations

import math

import torch
from torch.testing import assert_close

import autotp
from autotp.capture import capture, example_inputs_of
from autotp.options import Options, Recompute
from autotp.planning.layout_search import search_layouts
from autotp.planning.machines import machine_for
from tests import models
from tests.workers import ADAM, STEPS

BATCH, SEQ = 8, 12
"""The global batch the layout is searched for and trained on (each replica takes its slice)."""


def _train_like_one_process(pm, ref, label: str) -> None:
    """STEPS AdamW steps of ``pm`` on its replica's slice against ``ref`` on the whole batch: the mean loss over
    the replicas each step, every parameter after."""
    x, y = models.tokens(BATCH, SEQ, seed=2), models.target_for("gpt", BATCH, SEQ, seed=3)
    dp = pm.dp_size
    rows = slice(pm.dp_rank * BATCH // dp, (pm.dp_rank + 1) * BATCH // dp)
    opt, ref_opt = torch.optim.AdamW(pm.parameters(), **ADAM), torch.optim.AdamW(ref.parameters(), **ADAM)
    for step in range(STEPS):
        loss = pm.step(x[rows], target=y[rows], loss_fn=models.loss_fn)
        ref_loss = models.loss_fn(ref(x), y)
        ref_loss.backward()
        everyone = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(everyone, (pm.dp_rank, loss.item()))
        mean = sum(dict(everyone).values()) / dp
        assert math.isclose(mean, ref_loss.item(), rel_tol=1e-5), f"{label} step {step}: {mean} vs {ref_loss.item()}"
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
    full = pm.full_state_dict()
    for key, want in ref.state_dict().items():
        assert_close(full[key], want, rtol=1e-5, atol=1e-5, msg=lambda m: f"{label} {key} after AdamW: {m}")


def _budget_only_recompute_fits(world: int) -> int:
    """A memory budget under every layout's without recompute and over some layout's with it."""
    model = models.build("gpt", layers=2)
    captured = capture(model, example_inputs_of(model, (models.tokens(BATCH, SEQ, seed=1),)))
    ranked = search_layouts(captured, world, Options(), {}, machine_for("cpu")).ranked
    budget = min(p.memory for p in ranked if p.layout.recompute is Recompute.NONE) - 1
    assert min(p.memory for p in ranked) <= budget, "recompute saves nothing here"
    return budget


def check_chosen_layouts(rank: int, world: int) -> dict:
    """Three parallelize calls over the spawned group: nothing given (the planner chooses everything for the
    group's ranks), tp=2 fixed, and a memory budget only recompute meets; each trains like one process. Returns
    the layouts chosen."""
    chosen = {}
    for label, settings in (("free", {}), ("tp=2", {"tp": 2, "world_size": world}),
                            ("budget", {"memory_budget": _budget_only_recompute_fits(world)})):
        ref = models.build("gpt", layers=2)
        pm = autotp.parallelize(ref, example_inputs=(models.tokens(BATCH, SEQ, seed=1),), **settings)
        best = pm.plan.layouts[0].layout
        assert (pm.plan.tp, pm.plan.pp, pm.dp_size) == (best.tp, best.pp, best.dp), label
        _train_like_one_process(pm, ref, label)
        chosen[label] = best.label()
    return chosen
