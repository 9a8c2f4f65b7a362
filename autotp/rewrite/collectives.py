"""Megatron's communication operators as autograd functions, wrapped in modules the rewrite inserts.

``f`` (CopyToTP): identity forward, all-reduce backward; before a column-split region.
``g`` (ReduceFromTP): all-reduce forward, identity backward; after a row-split projection.
``GatherFromTP``: all-gather forward, keep-own-slice backward; when a split value must be whole.
``ScatterToTP``: keep-own-slice forward, all-gather backward; when a whole value meets a split one.
``OutputGather``: a ``GatherFromTP`` at the model's output, which a training step may defer.
``ReduceScatterToTP`` and ``GatherToRegion``: sequence parallelism's ``g`` and the gather into a region.
``GatherShared``, ``ScatterShared``, ``SharedGrad``: the same for chunks several ranks hold (``Shard.replicas``);
``Narrow`` keeps a rank's plain part of such a chunk, with no communication.
``VocabParallelCrossEntropy``: Megatron's cross-entropy over class-split logits (the logits never gathered;
the computation itself is ``vocab_parallel``'s).

``IMPLEMENTATIONS`` maps each ``Operator`` (whose wire behaviour ``autotp.passes.steps.COMMUNICATION``
describes) to the module that runs it: adding a collective means one entry there and one here.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from autotp.passes.placement import (
    Shard,
    assemble,
    assemble_blocks,
    chunk_lengths,
    local_shard,
)
from autotp.passes.steps import Operator
from autotp.rewrite.comm import Communicator, all_gather_chunks
from autotp.rewrite.grad_bucket import GradSum, reduce_with_shares
from autotp.rewrite.running_stats import ChannelBatchNorm
from autotp.rewrite.shards import local_value, runtime_segments
from autotp.rewrite.vocab_parallel import MEAN, vocab_parallel_cross_entropy


def gather_along(comm: Communicator, x: torch.Tensor, dim: int, segments: tuple[int, ...],
                 blocked: bool = False) -> torch.Tensor:
    """``x`` (this rank's piece along ``dim``, cut by ``segments`` or evenly) gathered whole from ``comm``'s ranks."""
    if segments:  # of static sizes, which a vocabulary's may cut unevenly (repeated over ``blocks`` or not)
        lengths = chunk_lengths(segments, comm.size)
        blocks = x.shape[dim] // lengths[comm.rank]
        parts = all_gather_chunks(comm, x, dim, [blocks * n for n in lengths])
    else:  # sized at run time: the sequence, checked to divide evenly
        parts = comm.all_gather(x)
    return (assemble_blocks if blocked else assemble)(parts, dim, segments)


def slice_along(x: torch.Tensor, dim: int, segments: tuple[int, ...], comm: Communicator, blocked: bool,
                rank: int | None = None) -> torch.Tensor:
    """This rank's (or ``rank``'s) piece of whole ``x`` along ``dim``, as ``gather_along`` would put it back."""
    return local_value(x, dim, segments, comm.rank if rank is None else rank, comm.size, blocked)


def _reduce_scattered(comm: Communicator, x: torch.Tensor, dim: int, segments: tuple[int, ...],
                      blocked: bool) -> torch.Tensor:
    """This rank's part of the sum over ranks of ``x``: every rank sends each peer that peer's part."""
    return comm.reduce_scatter([slice_along(x, dim, segments, comm, blocked, r) for r in range(comm.size)])


class _Copy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return reduce_with_shares(ctx.comm, grad), None


class _Reduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm):
        return comm.all_reduce(x)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _mine(comm: Communicator, x: torch.Tensor, dim: int, segments: tuple[int, ...], blocked: bool) -> torch.Tensor:
    return slice_along(x, dim, segments, comm, blocked)


def _on_split(name: str, forward, backward) -> type[torch.autograd.Function]:
    """An autograd function on a value split along a dim: ``forward`` and ``backward`` are each one of the
    operations above (gather, keep this rank's part, reduce-scatter), called as ``op(comm, x, dim, segments,
    blocked)``."""
    def run_forward(ctx, x, dim, segments, comm, blocked):
        ctx.args = (dim, segments, comm, blocked)
        return forward(comm, x, dim, segments, blocked)

    def run_backward(ctx, grad):
        dim, segments, comm, blocked = ctx.args
        return backward(comm, grad, dim, segments, blocked), None, None, None, None

    return type(name, (torch.autograd.Function,), {"forward": staticmethod(run_forward),
                                                    "backward": staticmethod(run_backward)})


_Gather = _on_split("_Gather", gather_along, _mine)
_Scatter = _on_split("_Scatter", _mine, gather_along)
_ReduceScatter = _on_split("_ReduceScatter", _reduce_scattered, gather_along)
# Into a region: its readers each hold this rank's share of the whole gradient (f's all-reduce would sum them);
# the part this rank keeps is the sum of every rank's share of that part.
_GatherToRegion = _on_split("_GatherToRegion", gather_along, _reduce_scattered)


def _groups(comm: Communicator, parts: list[torch.Tensor], replicas: int) -> list[torch.Tensor]:
    """One tensor per chunk from every rank's ``parts``: the sum of the shares of the ranks holding it."""
    return [torch.stack(parts[c * replicas:(c + 1) * replicas]).sum(0) for c in range(comm.size // replicas)]


class _GatherShared(torch.autograd.Function):
    """Gather chunks several ranks hold; backward, the first rank of each chunk's holders keeps its gradient
    (the others' shares are zero: their sum over the holders is the gradient)."""

    @staticmethod
    def forward(ctx, x, dim, segments, comm, replicas):
        ctx.args = (dim, segments, comm, replicas)
        return assemble(comm.all_gather(x)[::replicas], dim, segments)

    @staticmethod
    def backward(ctx, grad):
        dim, segments, comm, replicas = ctx.args
        mine = local_shard(grad, dim, segments, comm.rank // replicas, comm.size // replicas)
        return (mine if comm.rank % replicas == 0 else torch.zeros_like(mine)), None, None, None, None


class _ScatterShared(torch.autograd.Function):
    """Keep the chunk this rank shares with others; backward, each chunk's gradient is its holders' shares summed."""

    @staticmethod
    def forward(ctx, x, dim, segments, comm, replicas):
        ctx.args = (dim, segments, comm, replicas)
        return local_shard(x, dim, segments, comm.rank // replicas, comm.size // replicas)

    @staticmethod
    def backward(ctx, grad):
        dim, segments, comm, replicas = ctx.args
        return assemble(_groups(comm, comm.all_gather(grad), replicas), dim, segments), None, None, None, None


class _Narrow(torch.autograd.Function):
    """Keep this rank's part (its plain split's) of the chunk it shares with others; backward, the gradient in that
    part and zeros in the rest of the chunk: each holder's share, their sum the chunk's gradient."""

    @staticmethod
    def forward(ctx, x, dim, segments, comm, replicas):
        local = tuple(s // (comm.size // replicas) for s in segments)  # the chunk's segments, as this rank has them
        ctx.args = (dim, local, replicas, comm.rank % replicas)
        return local_shard(x, dim, local, comm.rank % replicas, replicas)

    @staticmethod
    def backward(ctx, grad):
        dim, local, replicas, mine = ctx.args
        parts = [grad if i == mine else torch.zeros_like(grad) for i in range(replicas)]
        return assemble(parts, dim, local), None, None, None, None


class _SharedGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm, replicas):
        ctx.args = (comm, replicas)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        comm, replicas = ctx.args
        return _groups(comm, comm.all_gather(grad), replicas)[comm.rank // replicas], None, None


class _Collective(nn.Module):
    """A communication the rewrite inserted; ``comm`` says over which ranks."""

    def __init__(self, comm: Communicator):
        super().__init__()
        self.comm = comm


class CopyToTP(_Collective):
    """Megatron's ``f``: identity forward, all-reduce of the gradient backward."""

    def forward(self, x):
        return _Copy.apply(x, self.comm)


class ReduceFromTP(_Collective):
    """Megatron's ``g``: all-reduce forward, identity backward."""

    def forward(self, x):
        return _Reduce.apply(x, self.comm)


class _Once(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm):
        return x.clone() if comm.rank == 0 else torch.zeros_like(x)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class AddOnce(_Collective):
    """A whole value about to be added to a partial sum: itself on rank 0, zeros on the others, so the sum over
    the ranks holds it once. Backward identity: the gradient of a partial sum is whole on every rank, and so is
    this value's."""

    def forward(self, x):
        return _Once.apply(x, self.comm)


class MeanFromTP(_Collective):
    """The mean over a split dim from the ranks' means over their equal shares: ``g``, then divide by tp."""

    def forward(self, x):
        return _Reduce.apply(x, self.comm) / self.comm.size


class _OnSplit(_Collective):
    """A collective about a value split along ``dim`` in ``segments`` (empty: one segment sized at run time)."""

    function: type[torch.autograd.Function]

    def __init__(self, comm: Communicator, dim: int, segments: tuple[int, ...], blocked: bool = False):
        super().__init__(comm)
        self.dim, self.segments, self.blocked = dim, tuple(segments), blocked

    def forward(self, x):
        return self.function.apply(x, self.dim, self.segments, self.comm, self.blocked)


class GatherFromTP(_OnSplit):
    """All-gather a value split along ``dim`` (in ``segments``); backward keeps this rank's slice."""

    function = _Gather


class ScatterToTP(_OnSplit):
    """Keep this rank's slice of a whole value; backward all-gathers the gradient."""

    function = _Scatter


class ReduceScatterToTP(_OnSplit):
    """Sequence parallelism's ``g``: the sum over ranks, of which this rank keeps its part; backward all-gathers."""

    function = _ReduceScatter


class GatherToRegion(_OnSplit):
    """A gather, then ``f``: all-gather forward, reduce-scatter of the gradient backward."""

    function = _GatherToRegion

    def gathered(self, x):
        """The gathered value of ``x`` outside autograd (a reader's second gather, in its backward)."""
        return gather_along(self.comm, x, self.dim, self.segments, self.blocked)


class _OnShared(_Collective):
    """A collective about chunks ``replicas`` ranks each hold (``Shard.replicas``)."""

    function: type[torch.autograd.Function]

    def __init__(self, comm: Communicator, dim: int, segments: tuple[int, ...], replicas: int):
        super().__init__(comm)
        self.dim, self.segments, self.replicas = dim, tuple(segments), replicas

    def forward(self, x):
        return self.function.apply(x, self.dim, self.segments, self.comm, self.replicas)


class GatherShared(_OnShared):
    """All-gather chunks several ranks hold, one copy each; backward, one holder keeps each chunk's gradient."""

    function = _GatherShared


class ScatterShared(_OnShared):
    """Keep the chunk this rank shares; backward, the holders' gradient shares summed and all-gathered."""

    function = _ScatterShared


class Narrow(_OnShared):
    """Keep this rank's plain part of a chunk several ranks hold (no communication); backward, zeros elsewhere."""

    function = _Narrow


class SharedGrad(_Collective):
    """A parameter chunk several ranks hold: identity forward; backward, the holders' gradient shares summed."""

    def __init__(self, comm: Communicator, replicas: int):
        super().__init__(comm)
        self.replicas = replicas

    def forward(self, x):
        return _SharedGrad.apply(x, self.comm, self.replicas)


class OutputGather(GatherFromTP):
    """The gather that makes a split model output whole. A training step that needs only the loss defers it
    (``runtime.outputs``): while ``deferred`` is a list, the output stays split and is recorded there with this
    gather, which the step runs only if its loss needs the whole value."""

    deferred: list | None = None
    overwritable: bool = False
    """Set by the rewrite where the split value is the loss's to overwrite (``rewrite.output_values``)."""

    def forward(self, x):
        if self.deferred is None:
            return self.whole(x)
        self.deferred.append((x, self))
        return x

    def whole(self, x):
        """The gathered value (what ``forward`` returns when not deferred)."""
        return super().forward(x)


class VocabParallelCrossEntropy(_Collective):
    """``aten.cross_entropy_loss`` on class-split logits, label smoothing included (the rule admits no class
    weights); ``classes``: how many in all (None: as many on every rank); ``overwrite``: the logits are the loss's
    to overwrite (nothing else reads them: the runtime's loss on a model's split output)."""

    def __init__(self, comm: Communicator, classes: int | None = None, overwrite: bool = False):
        super().__init__(comm)
        self.classes, self.overwrite = classes, overwrite

    def forward(self, logits, target, weight=None, reduction=MEAN, ignore_index=-100, label_smoothing=0.0):
        return vocab_parallel_cross_entropy(logits, target, self.comm, reduction, ignore_index, self.overwrite,
                                            label_smoothing=label_smoothing, classes=self.classes)


def _classes(shard: Shard | None) -> int | None:
    """The classes in all of logits split as ``shard`` (None: sized at run time, or not told)."""
    segments = runtime_segments(shard.segments) if shard is not None else ()
    return segments[0] if len(segments) == 1 else None


def split_args(shard: Shard) -> tuple:
    """A split's (dim, segments as torch takes them, blocked) for the modules above."""
    return shard.dim, runtime_segments(shard.segments), shard.blocks != 1


IMPLEMENTATIONS: dict[Operator, Callable[[Communicator, Shard | None], nn.Module]] = {
    Operator.F: lambda comm, shard: CopyToTP(comm),
    Operator.G: lambda comm, shard: ReduceFromTP(comm),
    Operator.VOCAB_EMBEDDING: lambda comm, shard: ReduceFromTP(comm),
    Operator.MEAN: lambda comm, shard: MeanFromTP(comm),
    Operator.CROSS_ENTROPY: lambda comm, shard: VocabParallelCrossEntropy(comm, _classes(shard)),
    Operator.GATHER: lambda comm, shard: (GatherFromTP(comm, *split_args(shard)) if shard.replicas == 1 else
                                          GatherShared(comm, shard.dim, shard.segments, shard.replicas)),
    Operator.SCATTER: lambda comm, shard: (ScatterToTP(comm, *split_args(shard)) if shard.replicas == 1 else
                                           ScatterShared(comm, shard.dim, shard.segments, shard.replicas)),
    Operator.SHARED_GRAD: lambda comm, shard: SharedGrad(comm, shard.replicas),
    Operator.ONCE: lambda comm, shard: AddOnce(comm),
    Operator.NARROW: lambda comm, shard: Narrow(comm, shard.dim, runtime_segments(shard.segments), shard.replicas),
    Operator.REDUCE_SCATTER: lambda comm, shard: ReduceScatterToTP(comm, *split_args(shard)),
    Operator.GATHER_TO_REGION: lambda comm, shard: GatherToRegion(comm, *split_args(shard)),
    Operator.RUNNING_STATS: lambda comm, shard: ChannelBatchNorm(comm, split_args(shard)[1]),
    Operator.GRAD_SUM: lambda comm, shard: GradSum(comm),
}
"""Operator -> a factory of the module that runs it, given the communicator and (for gathers and slices)
the split."""


def collective_module(operator: Operator, comm: Communicator, shard: Shard | None = None) -> nn.Module:
    """The module that runs ``operator`` over ``comm``'s ranks."""
    return IMPLEMENTATIONS[operator](comm, shard)
