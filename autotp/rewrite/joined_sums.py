"""Partial sums reduced side by side in one collective (``Propagation.riders``: DoRA's sums of squares, riding in
their layer's reduction, ``passes.dora_norms``).

The ranks' sums of independent values are independent, so one all-reduce of the values flattened end to end gives
every sum. Under sequence parallelism the carrier is reduce-scattered: each rank's piece is its part of the carrier
followed by a copy of every rider, so each rank receives its part summed and the riders summed whole.

Backward, the carrier's gradient is as its reduction's alone (identity after an all-reduce, an all-gather after a
reduce-scatter). The riders are read only through a ``detach`` (the planner joins no other): no gradient reaches
them, and none is returned. A rider of another dtype than the carrier (under autocast) is all-reduced on its own.
"""

from __future__ import annotations

import operator

import torch
from torch import fx, nn

from autotp.rewrite.collectives import gather_along, slice_along
from autotp.rewrite.comm import Communicator
from autotp.rewrite.graph_edit import STANDS_FOR, move_before


def _unpacked(flat: torch.Tensor, shapes: list[torch.Size]) -> list[torch.Tensor]:
    """``flat`` cut into tensors of ``shapes``, in order (any padding after them left out)."""
    out, start = [], 0
    for shape in shapes:
        n = shape.numel()
        out.append(flat[start:start + n].view(shape))
        start += n
    return out


def _flat(parts: list[torch.Tensor], length: int | None = None) -> torch.Tensor:
    """``parts`` flattened end to end, zero-padded to ``length``."""
    flat = torch.cat([p.reshape(-1) for p in parts])
    return flat if length is None or length == flat.numel() else torch.nn.functional.pad(flat, (0, length - flat.numel()))


class _JoinedReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, comm, x, *riders):
        summed = comm.all_reduce(_flat([x, *riders]))
        return tuple(_unpacked(summed, [x.shape, *[r.shape for r in riders]]))

    @staticmethod
    def backward(ctx, grad, *rider_grads):
        return (None, grad, *[None] * len(rider_grads))


class _JoinedReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, comm, split, x, *riders):
        dim, segments, blocked = split
        ctx.args = (comm, split, len(riders))
        parts = [slice_along(x, dim, segments, comm, blocked, r) for r in range(comm.size)]
        pieces = [[part, *riders] for part in parts]
        length = max(sum(t.numel() for t in piece) for piece in pieces)  # uneven parts: padded to one length
        mine = comm.reduce_scatter([_flat(piece, length) for piece in pieces])
        return tuple(_unpacked(mine, [parts[comm.rank].shape, *[r.shape for r in riders]]))

    @staticmethod
    def backward(ctx, grad, *rider_grads):
        comm, (dim, segments, blocked), riders = ctx.args
        return (None, None, gather_along(comm, grad, dim, segments, blocked), *[None] * riders)


class JoinedReduction(nn.Module):
    """Reduce a partial value and its riders in one collective: an all-reduce, or (``split``: the (dim, segments,
    blocked) of the part each rank keeps) a reduce-scatter of the value with every rider's sum on every rank."""

    def __init__(self, comm: Communicator, split: tuple | None = None):
        super().__init__()
        self.comm, self.split = comm, split

    def forward(self, x, *riders):
        # a rider of another dtype (float32 norms beside a bfloat16 output under autocast) is all-reduced on its
        # own: a side-by-side sum would cast one of them
        joined = [r for r in riders if r.dtype == x.dtype]
        if self.split is None:
            out = list(_JoinedReduce.apply(self.comm, x, *joined))
        else:
            out = list(_JoinedReduceScatter.apply(self.comm, self.split, x, *joined))
        summed = iter(out[1:])
        return (out[0], *[next(summed) if r.dtype == x.dtype else self.comm.all_reduce(r.detach()) for r in riders])


def reduce_with_riders(carrier: fx.Node, riders: list[fx.Node], module: nn.Module, add_module,
                       bias: fx.Node | None = None) -> None:
    """Replace the reads of ``carrier`` and of each of ``riders`` by their slices of one ``module`` call
    (``add_module(module)`` names it in the graph module); ``bias`` (a row-split layer's) is added after."""
    graph = carrier.graph
    for rider in riders:
        move_before(rider, carrier)
    parts = [carrier, *riders]
    readers = {part: list(part.users) for part in parts}
    with graph.inserting_after(carrier):
        joined = graph.call_module(add_module(module), tuple(parts))
    at = joined
    for i, part in enumerate(parts):
        with graph.inserting_after(at):
            at = graph.call_function(operator.getitem, (joined, i))
        value = at
        if i == 0 and bias is not None:
            with graph.inserting_after(at):
                at = value = graph.call_function(torch.ops.aten.add.Tensor, (at, bias))
        value.meta[STANDS_FOR] = part.name
        for user in readers[part]:
            user.replace_input_with(part, value)
    _after_joined(joined, at)


def _after_joined(joined: fx.Node, last: fx.Node) -> None:
    """Move the nodes before ``joined`` that read what it gives (a rider's readers: the norm's square root, the
    scale) and what they feed, in their order, to just after ``last`` (its last slice)."""
    reads: set[fx.Node] = set(joined.users)
    moving = []
    for node in joined.graph.nodes:
        if node is joined:
            break
        if any(a in reads for a in node.all_input_nodes):
            reads.add(node)
            moving.append(node)
    for node in moving:
        last.append(node)
        last = node
