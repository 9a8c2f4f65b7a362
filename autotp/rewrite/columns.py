"""Column projections with their communication fused in, as Megatron's column-parallel linear has it.

``RegatheredLinear``: under sequence parallelism a column region's input is all-gathered along the sequence
(``GatherToRegion``), and a projection reading it would save the whole gathered input for its weight gradient.
As Megatron does, it saves the shard instead and all-gathers it again in backward: one all-gather more per region
input, the whole input no longer held between forward and backward. Projections reading the same gathered value
(Q, K and V) share that second gather. ``RegatheredAddmm`` does the same for a layer computed on the gathered input
flattened to ``[B*T, C]`` (GPT-2's ``Conv1D``).

``OverlappedColumnLinear``: a projection that alone reads its input through ``f`` starts ``f``'s all-reduce of
the input gradient, computes its weight gradient meanwhile, and only then waits (Megatron's asynchronous
gradient all-reduce), instead of all-reducing after both.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from autotp.rewrite.collectives import GatherToRegion


def flat_grad(grad: torch.Tensor) -> torch.Tensor:
    """An output gradient as a (tokens, features) matrix, copied at most once: a gradient that arrives
    transposed (logits returned as ``transpose(0, 1).contiguous()``) would otherwise be copied by each matmul
    that reads it."""
    return grad.contiguous().view(-1, grad.shape[-1])


def owned_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` in a tensor of its own, for a custom autograd Function to return: torch's
    linear of a batched input returns a view of its matrix product, and autograd forbids writing a Function's
    view output in place (``F.relu(up(x), inplace=True)`` after a column projection). The product is written
    straight into the output (no copy); under autocast, or for mixed dtypes, torch's own linear."""
    if x.dim() <= 2 or torch.is_autocast_enabled(x.device.type) or x.dtype != weight.dtype \
            or (bias is not None and bias.dtype != x.dtype):
        return F.linear(x, weight, bias)
    out = torch.empty(*x.shape[:-1], weight.shape[0], dtype=x.dtype, device=x.device)
    flat_x, flat_out = x.reshape(-1, x.shape[-1]), out.view(-1, weight.shape[0])
    if bias is None:
        torch.mm(flat_x, weight.t(), out=flat_out)
    else:
        torch.addmm(bias, flat_x, weight.t(), out=flat_out)
    return out


class Regather:
    """The second gather of one ``GatherToRegion``'s input, shared by the projections that read its output: the
    first backward that needs it gathers, the others reuse it, the last one drops it.

    The readers that will need it say so in their forward (``expect``: those whose weight takes a gradient; a frozen
    base layer's backward needs only its weight), and the gathered value is found again by the shard's storage, not
    by the tensor object: autograd hands each backward its own wrapper of a saved tensor."""

    def __init__(self, gather: GatherToRegion):
        self.gather = gather
        self.cache: dict[tuple, list] = {}

    def start(self) -> None:
        """A new forward: whatever a previous one left (a backward that never ran) is dropped."""
        self.cache.clear()

    @staticmethod
    def _key(shard: torch.Tensor) -> tuple:
        return shard.untyped_storage().data_ptr(), shard.storage_offset(), tuple(shard.shape)

    def expect(self, shard: torch.Tensor) -> None:
        """One more backward will ask for the gathered value of ``shard``."""
        self.cache.setdefault(self._key(shard), [None, 0])[1] += 1

    def whole(self, shard: torch.Tensor) -> torch.Tensor:
        """The gathered value of ``shard`` (gathered on the first call for it; for a caller not expected, a gather
        of its own)."""
        key = self._key(shard)
        entry = self.cache.get(key)
        if entry is None:
            return self.gather.gathered(shard)
        if entry[0] is None:
            entry[0] = self.gather.gathered(shard)
        entry[1] -= 1
        if entry[1] <= 0:
            del self.cache[key]
        return entry[0]


def forward_dtype(x: torch.Tensor) -> torch.dtype | None:
    """The dtype a linear on ``x`` computes in here: autocast's where it is on (None: the tensors' own). A custom
    Function's backward runs outside autocast, so it must cast to this itself: its gradient then arrives in it
    (bf16 under a bf16 policy) while the saved input and weight are fp32."""
    kind = x.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else None


def in_dtype(dtype: torch.dtype | None, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``tensors`` cast to ``dtype`` (as autocast cast them in the forward; None: as they are). The gradients
    computed from them are cast back to each input's dtype by autograd, as after autocast's own cast."""
    return tensors if dtype is None else tuple(t.to(dtype) for t in tensors)


class _RegatheredLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, whole, shard, weight, bias, regather):
        ctx.save_for_backward(shard, weight)
        ctx.regather, ctx.has_bias, ctx.dtype = regather, bias is not None, forward_dtype(whole)
        return owned_linear(whole, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        shard, weight = ctx.saved_tensors
        grad_weight = None
        if ctx.needs_input_grad[2]:  # a frozen weight (LoRA's base) needs no gathered input
            x, weight, grad = in_dtype(ctx.dtype, ctx.regather.whole(shard), weight, grad)
            grad_weight = flat_grad(grad).t() @ x.reshape(-1, x.shape[-1])
        else:
            weight, grad = in_dtype(ctx.dtype, weight, grad)
        flat = flat_grad(grad)
        grad_bias = flat.sum(0) if ctx.has_bias and ctx.needs_input_grad[3] else None
        return (flat @ weight).view(*grad.shape[:-1], weight.shape[-1]), None, grad_weight, grad_bias, None


class RegatheredLinear(nn.Module):
    """``F.linear(whole, weight, bias)`` of a gathered ``whole``, saving only ``shard`` (its input) for backward."""

    def __init__(self, regather: Regather, first: bool):
        super().__init__()
        self.regather, self.first = regather, first

    def forward(self, whole, shard, weight, bias=None):
        if self.first:
            self.regather.start()
        if torch.is_grad_enabled() and weight.requires_grad:
            self.regather.expect(shard)
        return _RegatheredLinear.apply(whole, shard, weight, bias, self.regather)


class RegatheredAddmm(nn.Module):
    """``torch.addmm(bias, whole.reshape(-1, C), weight)`` of a gathered ``whole`` (GPT-2's ``Conv1D`` on flattened
    tokens, its weight stored ``[in, out]``), saving only ``shard``: ``RegatheredLinear`` of the transposed weight,
    flattened after."""

    def __init__(self, linear: RegatheredLinear):
        super().__init__()
        self.linear = linear

    def forward(self, whole, shard, bias, weight):
        out = self.linear(whole, shard, weight.t(), bias)
        return out.reshape(-1, out.shape[-1])


class _OverlappedColumn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, comm):
        ctx.save_for_backward(x, weight)
        ctx.comm, ctx.has_bias, ctx.dtype = comm, bias is not None, forward_dtype(x)
        return owned_linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight, grad = in_dtype(ctx.dtype, *ctx.saved_tensors, grad)
        flat = flat_grad(grad)
        finish = (ctx.comm.all_reduce_started((flat @ weight).view(*grad.shape[:-1], weight.shape[-1]))
                  if ctx.needs_input_grad[0] else None)
        grad_weight = flat.t() @ x.reshape(-1, x.shape[-1]) if ctx.needs_input_grad[1] else None
        grad_bias = flat.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return (finish() if finish is not None else None), grad_weight, grad_bias, None


class OverlappedColumnLinear(nn.Module):
    """``F.linear(f(x), weight, bias)`` with ``f``'s gradient all-reduce overlapping the weight gradient."""

    def __init__(self, comm):
        super().__init__()
        self.comm = comm

    def forward(self, x, weight, bias=None):
        return _OverlappedColumn.apply(x, weight, bias, self.comm)
