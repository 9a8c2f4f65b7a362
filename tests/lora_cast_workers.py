"""Per-rank bodies of the LoRA tests under a mixed-precision policy casting the parameters (``param_dtype``): the
adapters' whole matrices, which FSDP leaves out of its sharding, cast as FSDP casts the others."""

from __future__ import annotations

import copy

import torch

import autotp
from bench.comm import CommBytes
from tests import models
from tests.lora_workers import _loss, adapted, bucket_bytes, kinds


def fsdp_cast(tp: int, dp: int) -> dict:
    """SGD steps of learning rate 1 under fsdp with a mixed-precision policy casting FSDP's parameters, where the
    adapters' whole matrices stay out of FSDP's sharding and are cast as FSDP casts the others:

    - ``float32``: a parameter and reduction dtype of float32 (exact): the largest difference of any parameter from
      one process, and the kinds of collectives;
    - ``bfloat16``: ``param_dtype`` bfloat16 (reduced in it), against the same step in one process on a bfloat16
      copy of the model under bfloat16 autocast (the gradients then cast to the fp32 weights, as FSDP does), and
      against the same policy with the whole matrices left in FSDP's sharding (``sharded``: FSDP casts them and each
      share is summed where it arrives); the bytes of each all-reduce and this rank's bucket bytes;
    - ``replicate``: that bfloat16 policy under ``replicate`` (the graphs cast every parameter, the whole matrices
      after their ``GradSum``), against one process, and the kinds of collectives."""
    x, y = models.tokens(4, 8, 1), models.tokens(4, 8, 2)
    policy = autotp.MixedPrecision(compute_dtype=None, param_dtype="float32", reduce_dtype="float32")
    full, seen = _cast_step(policy, tp, dp, x, y)
    ref = _reference_step(x, y)
    worst = max((full[k] - v).abs().max().item() for k, v in ref.items() if v.is_floating_point())
    low = autotp.MixedPrecision(compute_dtype=None, param_dtype="bfloat16")
    out = {"worst": worst, "kinds": kinds(seen.events)}
    ours, seen, bucket = _cast_step(low, tp, dp, x, y, with_bucket=True)
    sharded, sharded_seen = _cast_step(low, tp, dp, x, y, keep_whole=False)
    start, one = adapted().state_dict(), _reference_step(x, y, torch.bfloat16)
    ours, sharded, one = _deltas(ours, start), _deltas(sharded, start), _deltas(one, start)
    out["bfloat16"] = {"vs_sharded": _differences(ours, sharded), "vs_one": _differences(ours, one),
                       "reduces": [n for what, n in seen.events if what == "all_reduce"],
                       "sharded_reduces": [n for what, n in sharded_seen.events if what == "all_reduce"],
                       "bucket": bucket, "kinds": kinds(seen.events)}
    replicated, seen = _cast_step(low, tp, dp, x, y, mode="replicate")
    out["replicate"] = {"vs_one": _differences(_deltas(replicated, start), one), "kinds": kinds(seen.events)}
    return out


def _cast_step(policy, tp: int, dp: int, x, y, keep_whole: bool = True, with_bucket: bool = False,
               mode: str = "fsdp"):
    """One SGD step (learning rate 1) of the adapted model under ``mode`` with ``policy``: the full state dict after it
    and the collectives seen (and this rank's bucket bytes, ``with_bucket``). Without ``keep_whole`` the adapters'
    whole matrices stay in FSDP's sharding (FSDP's own treatment of them, to compare with)."""
    from autotp.runtime import data_parallel

    kept = data_parallel.kept_whole
    if not keep_whole:
        data_parallel.kept_whole = lambda graphs: set()
    try:
        pm = autotp.parallelize(adapted().train(), tp=tp, dp=dp, dp_mode=mode, example_inputs=(x,), quiet=True,
                                mixed_precision=policy)
    finally:
        data_parallel.kept_whole = kept
    per = len(x) // dp
    mine = slice(pm.dp_rank * per, (pm.dp_rank + 1) * per)
    with CommBytes() as seen:
        pm.step(x[mine], target=y[mine], loss_fn=_loss)
    torch.optim.SGD([p for p in pm.parameters() if p.requires_grad], lr=1.0).step()
    done = (pm.full_state_dict(), seen)
    return (*done, bucket_bytes(pm)) if with_bucket else done


def _reference_step(x, y, dtype: torch.dtype | None = None) -> dict:
    """The state dict of the adapted model after one SGD step (learning rate 1) in one process; with ``dtype``, the
    gradients computed by a copy in ``dtype`` under autocast to it and cast to the fp32 parameters (FSDP's
    ``param_dtype``)."""
    model = adapted().train()
    runner = copy.deepcopy(model).to(dtype) if dtype is not None else model
    with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
        _loss(runner(x), y).backward()
    for p, q in zip(model.parameters(), runner.parameters()):
        if q.grad is not None:
            p.grad = q.grad.to(p.dtype)
    torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1.0).step()
    return model.state_dict()


def _deltas(state: dict, start: dict) -> dict:
    """What the step changed of each adapter weight (its gradient, at learning rate 1)."""
    return {k: start[k] - state[k] for k in start if "lora_" in k}


def _differences(got: dict, want: dict) -> dict[str, tuple[float, float]]:
    """Per name: the largest difference of ``got``'s tensor from ``want``'s, and ``want``'s largest magnitude."""
    return {k: ((got[k] - v).abs().max().item(), v.abs().max().item()) for k, v in want.items()}
