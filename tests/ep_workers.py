"""Per-rank bodies of the expert-parallel tests on gloo: a mixture of experts at ep=tp trained with AdamW on its
own loss (the auxiliary router loss included) next to the unsharded model, and its all-reduces counted at run
time."""

from __future__ import annotations

import torch

import autotp
from bench.comm import count_step
from tests import models
from tests.moe_workers import deepseek, mixtral
from tests.structures_workers import ADAM, STEPS, _error

BATCH, SEQ, HIDDEN, TOP_K = 3, 10, 64, 2


def routed(build):
    """``build()`` with its auxiliary load-balancing loss in ``output.loss``."""
    def made():
        model = build()
        model.config.output_router_logits = True
        model.config.router_aux_loss_coef = 0.5  # large enough that a wrong one would show
        return model
    return made


BUILDERS = {"mixtral": routed(mixtral), "deepseek": deepseek}


def _batch(seed: int) -> dict:
    ids = models.tokens(BATCH, SEQ, seed)
    return {"input_ids": ids, "labels": ids}


def to_first_experts(model):
    """``model`` with every router's weights zeroed: all logits tie, so the top-k picks the first k experts for
    every token (all on the first rank; the other ranks' experts get no token)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.zero_()
    return model


def trained(name: str, world: int, skewed: bool = False) -> dict:
    """Errors of ``name`` at tp=ep=world against the unsharded model: outputs, STEPS AdamW steps' losses, every
    parameter afterwards; and where its experts went. ``skewed``: every token routed to the first rank's experts."""
    torch.manual_seed(0)
    ref = BUILDERS[name]()
    if skewed:
        to_first_experts(ref)
    pm = autotp.parallelize(ref, tp=world, ep=world, example_inputs=_batch(1))
    first = _batch(2)
    out = {"output": _error(pm(**first).logits, ref(**first).logits)}
    opt, ref_opt = torch.optim.AdamW(pm.parameters(), **ADAM), torch.optim.AdamW(ref.parameters(), **ADAM)
    out["losses"] = []
    for step in range(STEPS):
        batch = _batch(3 + step)
        loss = pm.step(**batch)
        want = ref(**batch).loss
        want.backward()
        out["losses"].append(_error(loss.detach(), want.detach()))
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
    full = pm.full_state_dict()
    out["params"] = max(_error(full[k], v) for k, v in ref.state_dict().items() if v.is_floating_point())
    out["missing"] = sorted(set(ref.state_dict()) - set(full))
    out["expert_split"] = sorted(n for n, p in pm.plan.placements.items() if p.kind.value == "expert")
    local = {n: p.to_local() if hasattr(p, "to_local") else p for n, p in pm.named_parameters()}  # DTensors' shards
    out["local_experts"] = {n: p.shape[0] for n, p in local.items() if "experts" in n and p.dim() == 3}
    return out


def counted(name: str, world: int, ep: int) -> dict:
    """All-reduce bytes of one forward and backward at tp=world, ep=``ep`` (vocabulary whole), counted at run
    time, next to the bytes the plan lists."""
    torch.manual_seed(0)
    model = BUILDERS[name]()
    ids = models.tokens(BATCH, SEQ, 1)
    pm = autotp.parallelize(model, tp=world, ep=ep, vocab="whole", example_inputs=(ids,))
    got = count_step(lambda: pm(ids), lambda out: models.first_tensor(out).square().mean())
    listed = {d: sum(c.nbytes(BATCH, SEQ) for c in pm.plan.collectives if c.direction.value == d and c.in_step)
              for d in ("forward", "backward")}
    return {"counted": {d: got[d].get("all_reduce", {"bytes": 0})["bytes"] for d in ("forward", "backward")},
            "listed": listed,
            "expert": [(c.direction.value, c.shape) for c in pm.plan.collectives if "experts" in c.module]}


def expert_parallel(rank: int, world: int) -> dict:
    """Every model trained at ep=world, and Mixtral's all-reduces at ep=world and ep=1."""
    out = {name: trained(name, world) for name in BUILDERS}
    out["mixtral to one rank"] = trained("mixtral", world, skewed=True)
    out["bytes"] = {f"ep={ep}": counted("mixtral", world, ep) for ep in (1, world)}
    return out
