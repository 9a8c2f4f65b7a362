"""Per-rank bodies of the expert-parallel tests on gloo: a mixture of experts at ep=tp trained with AdamW on its
own loss (the auxiliary router loss included) next to the unsharded model, and its collectives counted at run
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


def mixtral_loop():
    """Mixtral with its experts run as transformers' eager loop over the experts hit (``W[e]`` per expert)."""
    model = mixtral()
    model.config._experts_implementation = "eager"
    return model


BUILDERS = {"mixtral": routed(mixtral), "deepseek": deepseek, "mixtral loop": routed(mixtral_loop)}


def one_token_batch() -> dict:
    """A batch of one token repeated: every position's hidden state is alike, so each MoE layer routes all its
    tokens to the same top-k experts (an example that reaches only those)."""
    ids = torch.full((BATCH, SEQ), 5)
    return {"input_ids": ids, "labels": ids}


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


def trained(name: str, world: int, skewed: bool = False, example: dict | None = None) -> dict:
    """Errors of ``name`` at tp=ep=world against the unsharded model: outputs, STEPS AdamW steps' losses, every
    parameter afterwards; and where its experts went. ``skewed``: every token routed to the first rank's experts.
    ``example``: the example inputs captured from (default: a batch like those trained)."""
    torch.manual_seed(0)
    ref = BUILDERS[name]()
    if skewed:
        to_first_experts(ref)
    pm = autotp.parallelize(ref, tp=world, ep=world, example_inputs=example or _batch(1))
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


OPS = ("all_reduce", "all_gather", "all_to_all")


def counted(name: str, world: int, ep: int) -> dict:
    """Bytes of one forward and backward at tp=world, ep=``ep`` (vocabulary whole), counted at run time per
    collective and direction, next to the bytes the plan lists (an all-to-all's per rank at balanced routing)."""
    torch.manual_seed(0)
    model = BUILDERS[name]()
    ids = models.tokens(BATCH, SEQ, 1)
    pm = autotp.parallelize(model, tp=world, ep=ep, vocab="whole", example_inputs=(ids,))
    got = count_step(lambda: pm(ids), lambda out: models.first_tensor(out).square().mean())
    listed = {f"{op} {d}": sum(c.nbytes(BATCH, SEQ) for c in pm.plan.collectives
                           if c.direction.value == d and c.in_step and c.op.value == op)
              for op in OPS for d in ("forward", "backward")}
    return {"counted": {f"{op} {d}": got[d].get(op, {"bytes": 0})["bytes"]
                        for op in OPS for d in ("forward", "backward")},
            "listed": listed,
            "expert": sorted({(c.op.value, c.direction.value, c.operator.value) for c in pm.plan.collectives
                              if "experts" in c.module})}


def loop_experts(rank: int, world: int, tps: tuple[int, ...]) -> dict:
    """Mixtral's loop over the experts hit, captured from a batch routing each layer's tokens to 2 of its 4 experts,
    at ep=world over tp (each of ``tps``) x dp ranks (``over_data_parallel``: trained on batches routing to every
    expert, and its output on the one-token batch)."""
    one = one_token_batch()
    return {f"tp={tp} dp={world // tp}": over_data_parallel("mixtral loop", tp, world // tp, world, example=one)
            for tp in tps}


def expert_parallel(rank: int, world: int) -> dict:
    """Every model with experts in banks read by grouped matmuls trained at ep=world, and Mixtral's collectives at
    ep=world and ep=1."""
    out = {name: trained(name, world) for name in BUILDERS if name != "mixtral loop"}
    out["mixtral to one rank"] = trained("mixtral", world, skewed=True)
    out["bytes"] = {f"ep={ep}": counted("mixtral", world, ep) for ep in (1, world)}
    return out


def _sliced(batch: dict, dp_rank: int, dp: int) -> dict:
    """Replica ``dp_rank``'s rows of ``batch``."""
    rows = slice(dp_rank * BATCH_DP // dp, (dp_rank + 1) * BATCH_DP // dp)
    return {k: v[rows] for k, v in batch.items()}


BATCH_DP = 4
"""The global batch of the data-parallel runs: each of up to 4 replicas takes its rows."""


def _global_batch(seed: int) -> dict:
    ids = models.tokens(BATCH_DP, SEQ, seed)
    return {"input_ids": ids, "labels": ids}


def _reference_loss(ref, batch: dict, dp: int) -> torch.Tensor:
    """The loss data parallelism trains: the mean over the replicas' slices of the model's own loss (its auxiliary
    router loss is the model's over each replica's tokens, as every replica computes it)."""
    return sum(ref(**_sliced(batch, r, dp)).loss for r in range(dp)) / dp


def over_data_parallel(name: str, tp: int, dp: int, ep: int, skewed: bool = False, mode: str = "replicate",
                       example: dict | None = None) -> dict:
    """Errors of ``name`` at (tp, dp, ep), replicas under ``mode``, against the unsharded model trained on the
    replicas' mean loss: outputs (also on a batch of one token, routed to one top-k), STEPS AdamW steps' losses and
    gradient norms, every parameter after them; the
    experts this rank holds; the all-to-all bytes of one forward and backward counted at run time."""
    torch.manual_seed(0)
    ref = BUILDERS[name]()
    if skewed:
        to_first_experts(ref)
    pm = autotp.parallelize(ref, tp=tp, dp=dp, ep=ep, dp_mode=mode, example_inputs=example or _batch(1))
    mine = lambda batch: _sliced(batch, pm.dp_rank, dp)  # noqa: E731
    first, one = _global_batch(2), mine(one_token_batch())
    out = {"output": _error(pm(**mine(first)).logits, ref(**mine(first)).logits),
           "one token": _error(pm(**one).logits, ref(**one).logits)}  # every token to the same top-k experts
    opt, ref_opt = torch.optim.AdamW(pm.parameters(), **ADAM), torch.optim.AdamW(ref.parameters(), **ADAM)
    out["losses"] = []
    for step in range(STEPS):
        batch = _global_batch(3 + step)
        loss = pm.step(**mine(batch))
        want = ref(**mine(batch)).loss.detach()
        _reference_loss(ref, batch, dp).backward()
        out["losses"].append(_error(loss.detach(), want))
        norm, ref_norm = pm.clip_grad_norm_(1e9), torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e9)
        out.setdefault("norms", []).append(_error(norm, ref_norm))
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
    out |= _after_steps(pm, ref)
    ids = models.tokens(BATCH_DP // dp, SEQ, 1)
    got = count_step(lambda: pm(ids), lambda o: models.first_tensor(o).square().mean())
    out["all_to_all"] = {d: got[d].get("all_to_all", {"bytes": 0})["bytes"] for d in ("forward", "backward")}
    return out


def _after_steps(pm, ref) -> dict:
    """The largest error of any parameter against the unsharded model's after the steps, and the numbers of
    experts this rank's banks hold."""
    full = pm.full_state_dict()
    local = {n: p.to_local() if hasattr(p, "to_local") else p for n, p in pm.named_parameters()}
    return {"params": max(_error(full[k], v) for k, v in ref.state_dict().items() if v.is_floating_point()),
            "local_experts": sorted({p.shape[0] for n, p in local.items() if "experts" in n and p.dim() == 3})}


def expert_parallel_over_dp(rank: int, world: int, configs: list) -> dict:
    """``over_data_parallel`` for each (name, tp, dp, ep, skewed) of ``configs``, on ``world`` ranks."""
    return {" ".join(map(str, c)): over_data_parallel(*c) for c in configs}


def _logits_loss(out, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), target.flatten())


def with_pipeline(rank: int, world: int, tp: int, pp: int, ep: int, dp: int = 1, mode: str = "replicate") -> dict:
    """Errors of Mixtral at (tp, pp, ep, dp), 2 microbatches, replicas under ``mode``, against the unsharded model:
    STEPS AdamW steps' losses (a cross-entropy of the logits: a pipeline takes target= and a loss_fn, not the
    model's own loss; each replica's over its rows) and every parameter after them; the experts this rank's stage
    holds."""
    torch.manual_seed(0)
    ref = mixtral()  # no router logits nor auxiliary loss among the outputs: a pipeline merges batch-sized ones
    replicas = {"dp": dp, "dp_mode": mode} if dp > 1 else {}
    pm = autotp.parallelize(ref, tp=tp, pp=pp, ep=ep, microbatches=2, example_inputs=(models.tokens(BATCH, SEQ, 1),),
                            **replicas)
    opt, ref_opt = torch.optim.AdamW(pm.parameters(), **ADAM), torch.optim.AdamW(ref.parameters(), **ADAM)
    out = {"losses": []}
    for step in range(STEPS):
        batch = _global_batch(3 + step)
        mine = _sliced(batch, pm.dp_rank, dp)  # the mean of equal slices' cross-entropies is the global batch's
        loss = pm.step(mine["input_ids"], target=mine["labels"], loss_fn=_logits_loss)
        want = _logits_loss(ref(mine["input_ids"]), mine["labels"]).detach()
        _logits_loss(ref(batch["input_ids"]), batch["labels"]).backward()
        out["losses"].append(_error(loss.detach(), want))
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
    out |= _after_steps(pm, ref)
    return out
