"""Per-rank bodies of the schedule tests: every pipeline schedule (zero-bubble ones included) against the
unsharded original: loss, every gradient, every parameter after AdamW steps."""

from __future__ import annotations

import torch
from torch.testing import assert_close

import autotp
from autotp.runtime.data_parallel import local
from autotp.runtime.state import gather_tp
from tests import models
from tests.distributed import largest_first
from tests.workers import ADAM, STEPS

BATCH, SEQ, MICRO = 8, 12, 4  # schedules need microbatches >= stages (4 at pp=2 with two stages per rank)
LAYERS = 4


def example() -> tuple:
    """The example inputs every schedule's model is captured on."""
    return (models.tokens(2, 16, seed=1),)


def full_grads(pm) -> dict[str, torch.Tensor]:
    """Every parameter's gradient, whole, under the original names, on every rank (collective)."""
    mine = {}
    for module in pm.rank_modules():
        for name, param in pm._names.params(module).items():
            grad = local(param.grad) if param.grad is not None else torch.zeros_like(local(param))
            mine[name] = gather_tp(pm.plan, name, grad, pm.comm)
    return pm._collect_stages(mine)


def check_grads(pm, ref: torch.nn.Module, label: str) -> None:
    """The pipelined model's gradients equal the original's (relative in norm, a 1e-7 floor for zeros)."""
    got = full_grads(pm)
    for name, param in ref.named_parameters():
        diff, scale = (got[name] - param.grad).norm().item(), param.grad.norm().item()
        assert diff <= 1e-5 * scale + 1e-7, f"{label}: gradient of {name} off by {diff:.2e} (norm {scale:.2e})"


def check_schedule(name: str, tp: int, pp: int, schedule: str, **settings) -> dict:
    """Train ``name`` for STEPS AdamW steps through ``schedule`` and unsharded; everything must agree."""
    ref = models.build(name, layers=LAYERS)
    pm = autotp.parallelize(ref, tp=tp, pp=pp, example_inputs=example(), microbatches=MICRO, schedule=schedule,
                            **settings)
    label = f"{name} tp={tp} pp={pp} {schedule} {settings}"
    x, y = models.tokens(BATCH, SEQ, seed=2), models.target_for(name, BATCH, SEQ, seed=3)
    opt, ref_opt = torch.optim.AdamW(pm.parameters(), **ADAM), torch.optim.AdamW(ref.parameters(), **ADAM)
    for step in range(STEPS):
        loss = pm.step(x, target=y, loss_fn=models.loss_fn)
        ref_loss = models.loss_fn(ref(x), y)
        ref_loss.backward()
        assert_close(loss, ref_loss.detach(), rtol=1e-5, atol=0, msg=lambda m: f"{label} loss: {m}")
        check_grads(pm, ref, f"{label} step {step}")
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
    full = pm.full_state_dict()
    for key, want in ref.state_dict().items():
        assert_close(full[key], want, rtol=1e-5, atol=1e-5, msg=lambda m: f"{label} {key} after AdamW: {m}")
    return {"stages": len(pm.plan.stages), "held": sorted(int(i) for i in pm.stages)}


def check_schedules(rank: int, world: int, tp: int, configs: list[list[str]]) -> dict:
    """``check_schedule`` for each (model, schedule[, recompute]) at tp and pp = world // tp."""
    out = {}
    for name, schedule, *recompute in configs:
        settings = {"recompute": recompute[0]} if recompute else {}
        out["/".join([name, schedule, *recompute])] = check_schedule(name, tp, world // tp, schedule, **settings)
    return out


def check_layouts(rank: int, world: int, layouts: list[list[int]], configs: list[list[str]]) -> dict:
    """``check_schedules`` at each [tp, pp] in one spawned group (the largest first): {"tp=.. pp=..": results}, on
    the ranks that ran each."""
    return {f"tp={tp} pp={pp}": check_schedules(rank, tp * pp, tp, configs)
            for tp, pp in largest_first(layouts, lambda layout: layout[0] * layout[1])}
