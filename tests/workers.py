"""Per-rank test bodies (importable, so spawned processes can run them).

Each compares the tensor-parallel model with the unsharded original, which every rank also builds:
outputs, loss, every gradient, and every parameter after AdamW steps.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from autotp.passes.placement import full_tensor
from torch.distributed.tensor.debug import CommDebugMode
from torch.testing import assert_close
from torch.utils._pytree import tree_leaves

import autotp
from autotp.runtime.data_parallel import local
from tests import models

# Adam divides by sqrt(v) + eps: on gradients that are zero up to rounding (the key bias has an exactly
# zero gradient) a tiny eps turns 1e-10 rounding noise into a visible step. eps=1e-6 keeps the comparison
# about sharding, not about amplified rounding; lr=1e-3 moves each parameter by ~1e-3 a step, so the
# parameter tolerance below (1e-5) is 1% of one step.
ADAM = dict(lr=1e-3, eps=1e-6)
STEPS = 2
"""Two steps show optimizer-state exactness: the second reads the moments the first stored in each shard."""


def lm_loss(out, target: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of logits ``out`` (any leading dims) against token ids ``target``."""
    return torch.nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), target.reshape(-1))


def assert_trains_like(pm, ref: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, rows=slice(None)) -> None:
    """STEPS AdamW steps of the parallel ``pm`` on ``x[rows]`` and of the unsharded ``ref`` on ``x``: every loss
    (where ``pm`` sees the whole batch), then every parameter after, equal to fp32 rounding."""
    opt, ref_opt = torch.optim.AdamW(pm.parameters(), **ADAM), torch.optim.AdamW(ref.parameters(), **ADAM)
    for _ in range(STEPS):
        loss, ref_loss = pm.step(x[rows], target=y[rows], loss_fn=lm_loss), lm_loss(ref(x), y)
        ref_loss.backward()
        if rows == slice(None):
            assert_close(loss, ref_loss.detach(), rtol=1e-5, atol=0)
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
    full = pm.full_state_dict()
    for key, want in ref.state_dict().items():
        assert_close(full[key], want, rtol=1e-5, atol=1e-5, msg=lambda m: f"{key}: {m}")


def _counts(mode: CommDebugMode) -> dict[str, int]:
    return {str(op).split(".")[-1].rstrip("_"): n for op, n in mode.get_comm_counts().items()}


def _full_grad(pm, name: str, grad: torch.Tensor) -> torch.Tensor:
    placement = pm.plan.placements[name]
    if not placement.is_split or pm.plan.tp == 1:
        return grad
    parts = [torch.empty_like(grad) for _ in range(pm.plan.tp)]
    dist.all_gather(parts, grad.contiguous())
    return full_tensor(placement, parts)  # chunks several ranks hold: their summed gradient, once


def _check_grads(pm, ref: torch.nn.Module, label: str) -> None:
    ref_params = dict(ref.named_parameters())
    for target, param in pm.module.named_parameters():
        name = target.removeprefix("model.")
        full = _full_grad(pm, name, local(param.grad))
        expected = ref_params[name].grad
        # Relative in norm, with a 1e-7 floor: some gradients are exactly zero in exact arithmetic (the
        # key bias: softmax ignores a shift), so both sides hold only rounding noise there.
        diff, scale = (full - expected).norm().item(), expected.norm().item()
        assert diff <= 1e-5 * scale + 1e-7, f"{label}: gradient of {name} off by {diff:.2e} (norm {scale:.2e})"


def check_model(name: str, tp: int) -> dict:
    """Shard model ``name`` over ``tp`` ranks and check it against the original; returns measurements."""
    ref = models.build(name)
    before = copy.deepcopy(ref.state_dict())
    pm = autotp.parallelize(ref, tp=tp, example_inputs=(models.tokens(2, 16, seed=1),))
    for key, value in ref.state_dict().items():
        assert torch.equal(value, before[key]), f"{name}: parallelize changed the user's {key}"

    # A different batch and sequence length than the example: shapes stay dynamic.
    x, y = models.tokens(3, 12, seed=2), models.target_for(name, 3, 12, seed=3)
    with CommDebugMode() as fwd_mode:
        out = pm(x)
    expected = ref(x)
    for got, want in zip(tree_leaves(out), tree_leaves(expected)):
        assert_close(got, want, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name} tp={tp} output: {m}")

    loss = models.loss_fn(out, y)
    with CommDebugMode() as bwd_mode:
        loss.backward()
    ref_loss = models.loss_fn(expected, y)
    ref_loss.backward()
    assert_close(loss, ref_loss, rtol=1e-5, atol=0, msg=lambda m: f"{name} tp={tp} loss: {m}")
    _check_grads(pm, ref, f"{name} tp={tp}")
    # The global gradient norm counts every element once, chunks several ranks hold included.
    norm, ref_norm = pm.clip_grad_norm_(1e9), torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e9)
    assert_close(norm, ref_norm, rtol=1e-5, atol=1e-7, msg=lambda m: f"{name} tp={tp} gradient norm: {m}")

    opt, ref_opt = torch.optim.AdamW(pm.parameters(), **ADAM), torch.optim.AdamW(ref.parameters(), **ADAM)
    for step in range(STEPS):
        if step:  # step 0 reuses the gradients checked above
            loss = pm.step(x, target=y, loss_fn=models.loss_fn)
            models.loss_fn(ref(x), y).backward()
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
    full = pm.full_state_dict()
    assert set(full) == set(ref.state_dict()), f"{name}: full_state_dict keys differ from the model's"
    for key, want in ref.state_dict().items():
        assert_close(full[key], want, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name} tp={tp} {key} after AdamW: {m}")

    split_total = sum(p.numel() for n, p in ref.named_parameters() if pm.plan.placements[n].is_split)
    shared = {n: p.numel() // pm.plan.placements[n].chunks(tp) for n, p in ref.named_parameters()
              if pm.plan.placements[n].replicas != 1}
    return {
        "shared_params": sum(ref.get_parameter(n).numel() for n in shared),
        "shared_local": sum(shared.values()),
        "shared_count": len(shared),
        "local_params": sum(local(p).numel() for p in pm.parameters()),
        "total_params": sum(p.numel() for p in ref.parameters()),
        "split_params": split_total,
        "forward": _counts(fwd_mode),
        "backward": _counts(bwd_mode),
        "planned": [[c.op, c.direction] for c in pm.plan.collectives],
        "blocks": sum(r.kind == "attention" for r in pm.plan.regions),
        "vocab_split": any(r.kind == "embedding" for r in pm.plan.regions),
        "head_split": any(r.kind == "lm_head" for r in pm.plan.regions),
        "lone_rows": sum(r.kind == "row" for r in pm.plan.regions),
        "notes": list(pm.plan.notes),
    }


def check_models(rank: int, world: int, names: list[str]) -> dict:
    """``check_model`` for each name at tp=world."""
    return {name: check_model(name, world) for name in names}


def wrong_world(rank: int, world: int) -> str:
    """parallelize with tp != world size must fail with a clear error."""
    try:
        autotp.parallelize(models.build("gpt"), tp=world * 2, example_inputs=(models.tokens(2, 8, 0),))
    except autotp.RuntimeSetupError as e:
        return str(e)
    return "no error"


def mismatched_plans(rank: int, world: int) -> str:
    """Ranks handed different plans must all fail before computing anything."""
    model = models.build("gpt")
    example = (models.tokens(2, 8, 0),)
    plan = autotp.plan(model, tp=world, example_inputs=example)
    if rank == 1:
        plan = plan.replace(notes=plan.notes + ("edited on rank 1",))
    try:
        autotp.parallelize(model, tp=world, example_inputs=example, plan=plan)
    except autotp.RuntimeSetupError as e:
        return str(e)
    return "no error"
