"""Per-rank body of the head-split attention test on gloo: SD3 with QK norm and Flux (dual- and single-stream
blocks) where diffusers is installed, DeBERTa-v2's disentangled attention and BEiT's relative-position bias (a
per-head table resized to the image's grid), each parallelized at tp=world and compared with an unsharded
copy after SGD steps (output, the loss of every step, every parameter afterwards)."""

from __future__ import annotations

import importlib.util

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

import autotp
from tests.test_attention_split import _beit, _deberta_v2
from devtools.zoo_diffusers import MODELS

STEPS, LR = 2, 1e-2


def _first(output) -> torch.Tensor:
    return next(t for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.is_floating_point())


def _loss(output, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(_first(output), target)


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    """The largest difference over the tensor's scale, at least 1: a bias that starts at zero moves by lr * its
    gradient per step, and its rounding is of that size, not of its own."""
    return float((got.double() - want.double()).abs().max() / want.double().abs().max().clamp(min=1.0))


def _check(model: nn.Module, inputs) -> dict:
    kwargs = inputs if isinstance(inputs, dict) else {}
    args = () if isinstance(inputs, dict) else inputs
    pm = autotp.parallelize(model, tp=torch.distributed.get_world_size(), example_inputs=inputs, quiet=True)
    reference = model
    output = _relative(_first(pm(*args, **kwargs)), _first(reference(*args, **kwargs)))
    opt, ref_opt = torch.optim.SGD(pm.parameters(), lr=LR), torch.optim.SGD(reference.parameters(), lr=LR)
    target = torch.randn(_first(reference(*args, **kwargs)).shape, generator=torch.Generator().manual_seed(3))
    losses = []
    for _ in range(STEPS):
        loss = pm.step(*args, target=target, loss_fn=_loss, **kwargs)
        ref_loss = _loss(reference(*args, **kwargs), target)
        ref_loss.backward()
        losses.append(_relative(loss, ref_loss.detach()))
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
    full = pm.full_state_dict()
    params = max(_relative(full[k], v) for k, v in reference.state_dict().items() if k in full and v.is_floating_point())
    split = sorted(n for n, p in pm.plan.placements.items() if p.is_split)
    return {"output": output, "losses": losses, "params": params, "split": split}


def heads(rank: int, world: int) -> dict:
    """Every model at tp=world, in one spawned group."""
    out = {}
    with_diffusers = importlib.util.find_spec("diffusers") is not None
    for name in ("SD3Transformer2DModel:qk_norm", "FluxTransformer2DModel") if with_diffusers else ():
        build, inputs = MODELS[name]
        torch.manual_seed(0)
        model = build()
        out[name] = _check(model, inputs(model))
    model, ids = _deberta_v2()
    out["deberta-v2"] = _check(model, (ids,))
    model, inputs = _beit(shared=False)
    out["beit"] = _check(model, inputs)
    return out
