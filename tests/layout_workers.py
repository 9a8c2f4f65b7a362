"""Per-rank bodies of the layout-search tests: the layout the planner chooses trains like one process."""

from __future__ import annotations

import math

import torch
from torch.testing import assert_close

import autotp
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


def check_chosen_layouts(rank: int, world: int) -> dict:
    """Two parallelize calls over the spawned group: nothing given (the planner chooses everything for the
    group's ranks) and tp=2 fixed; each trains like one process. Returns the layouts chosen."""
    chosen = {}
    for label, settings in (("free", {}), ("tp=2", {"tp": 2, "world_size": world})):
        ref = models.build("gpt", layers=2)
        pm = autotp.parallelize(ref, example_inputs=(models.tokens(BATCH, SEQ, seed=1),), **settings)
        best = pm.plan.layouts[0].layout
        assert (pm.plan.tp, pm.plan.pp, pm.dp_size) == (best.tp, best.pp, best.dp), label
        _train_like_one_process(pm, ref, label)
        chosen[label] = best.label()
    return chosen
