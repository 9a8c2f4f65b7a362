"""Per-rank body of the check that a pipeline stage cut inside a layer of a peft model (frozen embedding and base
weights, adapters on every projection) trains exactly as one process, under each schedule."""

from __future__ import annotations

import copy

import torch

import autotp
from tests import models
from tests.checkpoint_workers import ADAM
from tests.lora_workers import _loss, adapted

LAYER_0_MLP = "base_model.model.model.layers.0.mlp"
INNER = (("interleaved1f1b", 4, ()), ("1f1b", 4, (LAYER_0_MLP,)), ("gpipe", 2, (LAYER_0_MLP,)))
"""(schedule, microbatches, cuts): the planner's own 4 stages of the 2-layer model (each layer cut before its MLP),
then 2 stages cut by ``cuts=`` before the first layer's MLP."""


def inner_cuts(rank: int, world: int, layouts=INNER) -> list[dict]:
    """At tp=2 x pp=2, for each of ``layouts``: one ``pm.step`` and one AdamW step of the adapted 2-layer Llama
    against one process; the largest difference of any parameter after it, how far the adapters moved, and the
    module each later stage starts at."""
    x, y = models.tokens(4, 8, 1), models.tokens(4, 8, 2)
    out = []
    for schedule, micro, cuts in layouts:
        model = adapted().train()
        ref, start = copy.deepcopy(model), copy.deepcopy(model.state_dict())
        pm = autotp.parallelize(model, example_inputs=(x,), quiet=True, tp=2, pp=2, schedule=schedule,
                                microbatches=micro, cuts=list(cuts))
        opt = torch.optim.AdamW([p for p in pm.parameters() if p.requires_grad], **ADAM)
        pm.step(x, target=y, loss_fn=_loss)
        opt.step()
        ref_opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], **ADAM)
        _loss(ref(x), y).backward()
        ref_opt.step()
        full, want = pm.full_state_dict(), ref.state_dict()
        out.append({"schedule": schedule, "starts": [s.modules[0] for s in pm.plan.stages[1:]],
                    "worst": max((full[k] - v).abs().max().item() for k, v in want.items() if v.is_floating_point()),
                    "moved": max((want[k] - start[k]).abs().max().item() for k in want if "lora_" in k)})
    return out
