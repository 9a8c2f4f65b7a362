"""Per-rank bodies of the mixed-precision tests on gloo: the parallel module under ``torch.autocast``, under a
``MixedPrecision`` policy and after ``pm.to(dtype)``, against the unsharded model run the same way.

bf16 results are not bit-equal to the unsharded model's (a row-parallel sum is rounded per rank), so each
comparison is measured against the unsharded model's own bf16-vs-fp32 gap: the difference from the unsharded
bf16 run must be within it (and a fault, a wrong shard or a missed collective, is far outside it)."""

from __future__ import annotations

import contextlib
import copy

import torch
import torch.distributed as dist
from torch.func import functional_call
from torch.testing import assert_close

import autotp
from tests import models
from tests.workers import ADAM

BATCH, SEQ = 4, 16


def _batch(labels: bool) -> dict:
    ids = models.tokens(BATCH, SEQ, seed=2)
    return {"input_ids": ids, "labels": ids} if labels else {"input_ids": ids}


def _policy_loss(model, policy: autotp.MixedPrecision | None, x, y) -> torch.Tensor:
    """The unsharded model's loss under ``policy``: forward and loss under autocast to its compute dtype (as the
    user writes it), parameters cast to its param dtype (the cast is differentiable: gradients land on the fp32
    parameters)."""
    context = torch.autocast("cpu", dtype=policy.compute) if policy and policy.compute else contextlib.nullcontext()
    with context:
        if policy is None or policy.param is None:
            return models.loss_fn(model(x), y)
        cast = {n: p.to(policy.param) for n, p in model.named_parameters()}
        return models.loss_fn(functional_call(model, cast, (x,), tie_weights=True), y)


def _trained(model, policy, steps: int, x, y) -> tuple[list[float], dict]:
    """``steps`` AdamW steps of the unsharded ``model`` under ``policy`` (None: fp32): the losses, the state."""
    opt, losses = torch.optim.AdamW(model.parameters(), **ADAM), []
    for _ in range(steps):
        loss = _policy_loss(model, policy, x, y)
        loss.backward()
        opt.step(), opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _gap(a: dict, b: dict) -> float:
    """The root-mean-square difference over every element of ``b``'s tensors (a max would measure one ulp: a
    bf16 value one rounding step apart is the largest difference of either comparison)."""
    squares = sum(float(((a[k].double() - b[k].double()) ** 2).sum()) for k in b)
    return (squares / sum(b[k].numel() for k in b)) ** 0.5


def _rms(a: torch.Tensor, b: torch.Tensor) -> float:
    return _gap({"t": a}, {"t": b})


def _replica_mean(loss: float, dp_rank: int) -> float:
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (dp_rank, loss))
    per_replica = dict(everyone)
    return sum(per_replica.values()) / len(per_replica)


def policy_training(rank: int, world: int, layout: dict, policy: dict, steps: int, layers: int) -> dict:
    """``steps`` AdamW steps of a ``layers``-layer Llama parallelized with ``layout`` and ``mixed_precision=policy``
    (each replica on its slice), against the unsharded model trained under the same policy and in fp32: the
    largest loss and parameter differences from the unsharded policy run, and its own gap to fp32."""
    chosen = autotp.MixedPrecision(**policy)
    ref = models.build("hf_llama", layers=layers)
    x, y = models.tokens(BATCH, SEQ, seed=2), models.target_for("hf_llama", BATCH, SEQ, seed=3)
    pm = autotp.parallelize(copy.deepcopy(ref), example_inputs=(x[:2],), mixed_precision=chosen,
                            microbatches=2 if layout.get("pp", 1) > 1 else None, **layout)
    assert pm.plan.options.mixed_precision == chosen  # recorded in the plan (and its file)
    dp = layout.get("dp", 1)
    rows = slice(pm.dp_rank * BATCH // dp, (pm.dp_rank + 1) * BATCH // dp)
    opt, losses = torch.optim.AdamW(pm.parameters(), **ADAM), []
    for _ in range(steps):
        losses.append(_replica_mean(pm.step(x[rows], target=y[rows], loss_fn=models.loss_fn).item(), pm.dp_rank))
        opt.step(), opt.zero_grad()
    assert all(p.dtype == torch.float32 for p in pm.parameters())  # fp32 master weights
    if layout.get("dp_mode") == "fsdp":  # FSDP casts its own parameters: pm.to(dtype) refused, nothing cast
        try:
            pm.to(torch.bfloat16)
            raise AssertionError("pm.to(dtype) under fsdp was not refused")
        except autotp.InputError as e:
            assert "MixedPrecision(param_dtype" in str(e)
        assert all(p.dtype == torch.float32 for p in pm.parameters())
    full = pm.full_state_dict()
    want_losses, want = _trained(copy.deepcopy(ref), chosen, steps, x, y)
    fp32_losses, fp32 = _trained(copy.deepcopy(ref), None, steps, x, y)
    return {"loss_diff": max(abs(a - b) for a, b in zip(losses, want_losses)),
            "loss_gap": max(abs(a - b) for a, b in zip(want_losses, fp32_losses)),
            "loss_to_fp32": max(abs(a - b) for a, b in zip(losses, fp32_losses)),
            "param_diff": _gap(full, want), "param_gap": _gap(want, fp32), "param_to_fp32": _gap(full, fp32)}


def user_autocast(rank: int, world: int, labels: bool, steps: int) -> dict:
    """A module captured in fp32 (``parallelize`` called inside autocast: the capture is the same) runs under the
    user's ``torch.autocast`` in ``pm(**batch)`` and ``pm.step(**batch)``, and in fp32 outside it, exactly."""
    ref = models.build("hf_llama", layers=2)
    batch = _batch(labels)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        pm = autotp.parallelize(copy.deepcopy(ref), tp=world, example_inputs=batch)
    out, want = pm(**batch), ref(**batch)
    assert out.logits.dtype == torch.float32
    assert_close(out.logits, want.logits, rtol=1e-5, atol=1e-5)  # fp32 outside autocast, as captured
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got_bf16, want_bf16 = pm(**batch).logits, ref(**batch).logits
    result = {"logits_diff": _rms(got_bf16, want_bf16), "logits_gap": _rms(want_bf16, want.logits),
              "dtype": str(got_bf16.dtype)}
    if not labels:
        return result
    bf16_ref, opt, ref_opt = copy.deepcopy(ref), torch.optim.AdamW(pm.parameters(), **ADAM), None
    ref_opt = torch.optim.AdamW(bf16_ref.parameters(), **ADAM)
    diffs = []
    for _ in range(steps):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = pm.step(**batch)
            ref_loss = bf16_ref(**batch).loss
            ref_loss.backward()
        diffs.append(abs(loss.item() - ref_loss.item()))
        opt.step(), ref_opt.step(), opt.zero_grad(), ref_opt.zero_grad()
    _, fp32 = _trained_own(copy.deepcopy(ref), steps, batch)
    full = pm.full_state_dict()
    return result | {"loss_diff": max(diffs), "param_diff": _gap(full, bf16_ref.state_dict()),
                     "param_gap": _gap(bf16_ref.state_dict(), fp32),
                     "fp32_after": float((pm(**batch).loss - bf16_ref(**batch).loss).abs())}


def _trained_own(model, steps: int, batch: dict):
    opt = torch.optim.AdamW(model.parameters(), **ADAM)
    for _ in range(steps):
        model(**batch).loss.backward()
        opt.step(), opt.zero_grad()
    return None, model.state_dict()


def to_dtype(rank: int, world: int) -> dict:
    """``pm.to(torch.bfloat16)`` after parallelizing runs (forward, step, a loss_fn's graph) near the model
    converted to bf16, and ``pm.to(torch.float32)`` brings back the fp32 module exactly."""
    ref = models.build("hf_llama", layers=2)
    batch = _batch(True)
    pm = autotp.parallelize(copy.deepcopy(ref), tp=world, example_inputs=batch)
    x, y = batch["input_ids"], models.target_for("hf_llama", BATCH, SEQ, seed=3)
    pm.to(torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in pm.parameters())
    got, half = pm(**batch), copy.deepcopy(ref).to(torch.bfloat16)
    want, fp32 = half(**batch), ref(**batch)
    assert got.logits.dtype == torch.float32 and got.loss.dtype == torch.float32  # upcast for the loss, as HF does
    result = {"logits_diff": _rms(got.logits, want.logits), "logits_gap": _rms(want.logits, fp32.logits),
              "loss_diff": abs(got.loss.item() - want.loss.item()),
              "loss_gap": abs(want.loss.item() - fp32.loss.item())}
    pm.step(**batch)  # the model's own loss; gradients in bf16, on the bf16 parameters
    assert all(p.grad.dtype == torch.bfloat16 for p in pm.parameters())
    plain = autotp.parallelize(copy.deepcopy(ref), tp=world, example_inputs=(x,)).to(torch.bfloat16)
    user = plain.step(x, target=y, loss_fn=models.loss_fn)  # the model captured with the loss, after the cast
    result["user_loss_diff"] = abs(user.item() - models.loss_fn(half(x), y).item())
    pm.zero_grad()
    pm.to(torch.float32)
    again = pm(**batch)
    assert again.logits.dtype == torch.float32
    # back in fp32 from bf16-rounded weights: exactly the fp32 model with those weights
    rounded = copy.deepcopy(ref).to(torch.bfloat16).to(torch.float32)
    assert_close(again.logits, rounded(**batch).logits, rtol=1e-5, atol=1e-5)
    pm.double()  # up: the graphs' fp32 constants become float64 (the model's explicit .float() upcasts included)
    wide = pm(**batch)
    assert wide.logits.dtype == torch.float64
    assert_close(wide.logits, rounded.double()(**batch).logits, rtol=1e-5, atol=1e-5)
    return result


def pipeline_to_dtype(rank: int, world: int) -> dict:
    """``pm.to(torch.bfloat16)`` on a pipeline (pp=2): its schedule is built again for the bf16 stages, and a step
    trains near the unsharded model converted to bf16."""
    ref = models.build("hf_llama", layers=2)
    x, y = models.tokens(BATCH, SEQ, seed=2), models.target_for("hf_llama", BATCH, SEQ, seed=3)
    pm = autotp.parallelize(copy.deepcopy(ref), tp=1, pp=world, example_inputs=(x[:2],), microbatches=2)
    first = pm.step(x, target=y, loss_fn=models.loss_fn)  # builds the fp32 schedule
    assert_close(first, models.loss_fn(ref(x), y), rtol=1e-5, atol=1e-5)
    pm.zero_grad()
    pm.to(torch.bfloat16)
    loss = pm.step(x, target=y, loss_fn=models.loss_fn)
    half = copy.deepcopy(ref).to(torch.bfloat16)
    want, fp32 = models.loss_fn(half(x), y).float(), models.loss_fn(ref(x), y)
    assert all(p.dtype == torch.bfloat16 for p in pm.parameters())
    return {"loss_diff": abs(loss.item() - want.item()), "loss_gap": abs(want.item() - fp32.item())}


def to_dtype_then_train(rank: int, world: int) -> dict:
    """After ``pm.to(torch.bfloat16)``: a forward, an SGD step, another forward, near the bf16 unsharded model run
    the same way; then a replicated weight changed on the last rank alone is caught (``DriftError``): the drift
    fingerprints read the bf16 parameters, not the fp32 tensors they replaced."""
    from torch.distributed.tensor import DTensor

    ref, batch = models.build("hf_llama", layers=2), _batch(True)
    pm = autotp.parallelize(copy.deepcopy(ref), tp=world, example_inputs=batch, quiet=True).to(torch.bfloat16)
    half = copy.deepcopy(ref).to(torch.bfloat16)
    for model in (pm, half, ref):
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        model(**batch).loss.backward()
        opt.step()
    got, want, fp32 = pm(**batch), half(**batch), ref(**batch)
    result = {"logits_diff": _rms(got.logits, want.logits), "logits_gap": _rms(want.logits, fp32.logits)}
    whole = [p for p in pm.parameters() if isinstance(p, DTensor) and p.placements[0].is_replicate()]
    with torch.no_grad():
        if rank == world - 1:
            whole[0].to_local().add_(1.0)
    try:
        pm(**batch)
        result["drift"] = "not raised"
    except autotp.errors.DriftError as e:
        result["drift"] = str(e)
    return result
