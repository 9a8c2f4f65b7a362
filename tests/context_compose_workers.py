"""Per-rank bodies of the tests of context parallelism composed with tensor, data and pipeline parallelism on gloo:
outputs, losses, every gradient and every parameter after AdamW steps equal the unsharded model's."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.testing import assert_close

import autotp
from tests import models
from tests.context_workers import build
from tests.workers import ADAM, STEPS


def _whole(grad: torch.Tensor) -> torch.Tensor:
    """A gradient whole: a DTensor's (tensor-parallel shards, FSDP shards) gathered; collective over its mesh."""
    return grad.full_tensor() if isinstance(grad, DTensor) else grad


def _check_grads(pm, ref, label: str) -> float:
    """Every gradient of ``pm`` (gathered whole) equals ``ref``'s; the largest error. Collective."""
    worst, ref_params = 0.0, dict(ref.named_parameters())
    for module in pm.rank_modules():
        for name, param in sorted(pm._names.params(module).items()):
            got, want = _whole(param.grad), ref_params[name].grad
            assert_close(got, want, rtol=1e-4, atol=1e-6, msg=lambda m: f"{label} grad {name}: {m}")
            worst = max(worst, float((got - want).abs().max()))
    return worst


def _check_exchanged(pm, cp: int, every_graph: bool) -> None:
    """Every graph (every pipeline stage) this rank holds computes its own chunks: its attentions' keys and values
    arrived from the other cp ranks; not ``every_graph``: some rank's at least (a model whose graph reads across
    positions computes whole from there on: OPT's last stage). Collective."""
    received = [sum(m.received for name, m in module.named_modules() if name.startswith("cp_kv_"))
                for module in pm.rank_modules()]
    if every_graph:
        assert min(received) > 0, f"a graph of this rank exchanged no keys or values at cp={cp}"
        return
    anywhere = torch.tensor(float(sum(received)))
    dist.all_reduce(anywhere)
    assert anywhere > 0, f"no rank exchanged keys or values at cp={cp}"


def train_composed(rank: int, world: int, name: str, settings: dict, every_graph: bool = True, seq: int = 16) -> dict:
    """``name`` at ``settings`` (cp with tp, dp or pp): eval outputs, then STEPS AdamW steps of cross-entropy (each
    replica on its rows of the batch) with the loss, every gradient, the gradient norm and every parameter afterwards
    equal to the unsharded model's on the whole batch; returns the largest errors."""
    ref = build(name)
    dp = settings.get("dp", 1)
    x, y = models.tokens(2 * dp, seq, 1), models.tokens(2 * dp, seq, 2)
    pm = autotp.parallelize(ref, example_inputs=x[:2], **{"tp": 1, **settings})
    rows = slice(2 * pm.dp_rank, 2 * pm.dp_rank + 2)
    pm.eval(), ref.eval()
    with torch.no_grad():
        got, want = models.first_tensor(pm(x[rows])), models.first_tensor(ref(x[rows]))
    assert_close(got, want, rtol=1e-5, atol=1e-6)
    errors = {"output": float((got - want).abs().max()), "loss": 0.0, "grad": 0.0}
    pm.train(), ref.train()
    opt, ref_opt = torch.optim.AdamW(pm.parameters(), **ADAM), torch.optim.AdamW(ref.parameters(), **ADAM)
    for _ in range(STEPS):
        loss = pm.step(x[rows], target=y[rows], loss_fn=models.loss_fn)
        with torch.no_grad():
            mine = models.loss_fn(ref(x[rows]), y[rows])  # this replica's rows' loss, as pm.step returns it
        ref_loss = models.loss_fn(ref(x), y)
        ref_loss.backward()
        assert_close(loss, mine, rtol=1e-5, atol=1e-6)
        errors["loss"] = max(errors["loss"], float((loss - mine).abs()))
        errors["grad"] = max(errors["grad"], _check_grads(pm, ref, f"{name} {settings}"))
        # each gradient counted once in the norm, not once per cp rank holding it
        norm, ref_norm = pm.clip_grad_norm_(1e6), torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e6)
        assert_close(norm, ref_norm, rtol=1e-5, atol=1e-7)
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
    _check_exchanged(pm, settings.get("cp", 1), every_graph)
    if settings.get("recompute", "none") != "none":  # the blocks of every graph this rank trains recompute
        assert all(any(n.startswith("autotp_recompute_") for n, _ in m.named_children()) for m in pm.rank_modules())
    full = pm.full_state_dict()
    for key, want in ref.state_dict().items():
        assert_close(full[key], want, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name} {settings} {key}: {m}")
    pm.close()
    return errors
