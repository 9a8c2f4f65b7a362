"""Megatron's communication operators as autograd functions, wrapped in modules the rewrite inserts.

``f`` (CopyToTP): identity forward, all-reduce backward; before a column-split region.
``g`` (ReduceFromTP): all-reduce forward, identity backward; after a row-split projection.
``GatherFromTP``: all-gather forward, keep-own-slice backward; when a split value must be whole.
``ScatterToTP``: keep-own-slice forward, all-gather backward; when a whole value meets a split one.

``IMPLEMENTATIONS`` maps each ``Operator`` (whose wire behaviour ``autotp.passes.steps.COMMUNICATION``
describes) to the module that runs it: adding a collective means one entry there and one here.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from autotp.passes.layout import Shard
from autotp.passes.steps import Operator
from autotp.rewrite.shards import assemble, local_shard


def _all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    out = x.contiguous().clone()
    dist.all_reduce(out, group=group)
    return out


def _all_gather(x: torch.Tensor, dim: int, segments: tuple[int, ...], group) -> torch.Tensor:
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return assemble(parts, dim, segments)


class _Copy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _Reduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, segments, group):
        ctx.args = (dim, segments, dist.get_rank(group), dist.get_world_size(group))
        return _all_gather(x, dim, segments, group)

    @staticmethod
    def backward(ctx, grad):
        dim, segments, rank, tp = ctx.args
        return local_shard(grad, dim, segments, rank, tp), None, None, None


class _Scatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, segments, group):
        ctx.args = (dim, segments, group)
        return local_shard(x, dim, segments, dist.get_rank(group), dist.get_world_size(group))

    @staticmethod
    def backward(ctx, grad):
        dim, segments, group = ctx.args
        return _all_gather(grad, dim, segments, group), None, None, None


class CopyToTP(nn.Module):
    """Megatron's ``f``: identity forward, all-reduce of the gradient backward."""

    def __init__(self, group):
        super().__init__()
        self.group = group

    def forward(self, x):
        return _Copy.apply(x, self.group)


class ReduceFromTP(nn.Module):
    """Megatron's ``g``: all-reduce forward, identity backward."""

    def __init__(self, group):
        super().__init__()
        self.group = group

    def forward(self, x):
        return _Reduce.apply(x, self.group)


class GatherFromTP(nn.Module):
    """All-gather a value split along ``dim`` (in ``segments``); backward keeps this rank's slice."""

    def __init__(self, group, dim: int, segments: tuple[int, ...]):
        super().__init__()
        self.group, self.dim, self.segments = group, dim, tuple(segments)

    def forward(self, x):
        return _Gather.apply(x, self.dim, self.segments, self.group)


class ScatterToTP(nn.Module):
    """Keep this rank's slice of a whole value; backward all-gathers the gradient."""

    def __init__(self, group, dim: int, segments: tuple[int, ...]):
        super().__init__()
        self.group, self.dim, self.segments = group, dim, tuple(segments)

    def forward(self, x):
        return _Scatter.apply(x, self.dim, self.segments, self.group)


IMPLEMENTATIONS: dict[Operator, Callable[[object, Shard | None], nn.Module]] = {
    Operator.F: lambda group, shard: CopyToTP(group),
    Operator.G: lambda group, shard: ReduceFromTP(group),
    Operator.VOCAB_EMBEDDING: lambda group, shard: ReduceFromTP(group),
    Operator.GATHER: lambda group, shard: GatherFromTP(group, shard.dim, shard.segments),
    Operator.SCATTER: lambda group, shard: ScatterToTP(group, shard.dim, shard.segments),
}
"""Operator -> a factory of the module that runs it, given the group and (for gathers and slices) the split."""


def collective_module(operator: Operator, group, shard: Shard | None = None) -> nn.Module:
    """The module that runs ``operator`` over ``group``."""
    return IMPLEMENTATIONS[operator](group, shard)


def masked_embedding(weight: torch.Tensor, ids: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """Look up ``ids`` in this rank's rows [start, end) of a vocabulary-split table; zeros elsewhere.

    Summed over ranks (by ``g``), this equals the lookup in the full table.
    """
    outside = (ids < start) | (ids >= end)
    local = torch.nn.functional.embedding((ids - start).masked_fill(outside, 0), weight)
    return local.masked_fill(outside.unsqueeze(-1), 0.0)
