"""The modules a context-parallel rank graph calls: which positions a rank holds, and the exchanges between ranks.

Positions are load-balanced for causal attention: the sequence is cut in ``2 * cp`` chunks and rank ``r`` holds
chunks ``r`` and ``2 * cp - 1 - r`` (as Megatron and torchtitan do), so every rank's queries see about as many keys.

Gradients follow one convention, which makes every exchange's backward the plain transpose of its forward: a
value every rank computes whole carries, on each rank, a share of its gradient (the shares sum to it), and a
value split along the sequence carries its own tokens' whole gradient. So a gather's backward reduce-scatters
(sums the shares, keeps the rank's tokens), the model's outputs (whole) start backward with ``1/cp`` of the
loss's gradient, and every parameter's gradient is summed over the ranks (``ParamGradSum``, Megatron's ``f``).
"""

from __future__ import annotations

import torch
from torch import nn

from autotp.errors import InputError
from autotp.rewrite.collectives import CopyToTP
from autotp.rewrite.comm import Communicator


def rank_positions(length: int, cp: int, rank: int) -> list[int]:
    """The positions rank ``rank`` of ``cp`` holds in a sequence of ``length``: chunks ``rank`` and
    ``2 * cp - 1 - rank`` of ``2 * cp`` equal chunks."""
    if length % (2 * cp):
        raise InputError(f"cp={cp} cuts the sequence into {2 * cp} equal chunks (two per rank, for causal balance), "
                         f"but it has {length} tokens; pad the sequence to a multiple of {2 * cp}")
    chunk = length // (2 * cp)
    first, last = rank * chunk, (2 * cp - 1 - rank) * chunk
    return [*range(first, first + chunk), *range(last, last + chunk)]


class Positions(nn.Module):
    """This rank's positions (a long tensor) in a sequence of the length it is called with, made once per length."""

    def __init__(self, cp: int, rank: int):
        super().__init__()
        self.cp, self.rank = cp, rank
        self._made: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def both(self, length: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """(this rank's positions, the order the ranks' tokens arrive in when gathered: rank 0's, then 1's...)."""
        key = (int(length), str(device))
        if key not in self._made:
            mine = torch.tensor(rank_positions(int(length), self.cp, self.rank), device=device)
            order = torch.tensor([p for r in range(self.cp) for p in rank_positions(int(length), self.cp, r)],
                                 device=device)
            self._made[key] = (mine, order)
        return self._made[key]

    def forward(self, length, like: torch.Tensor) -> torch.Tensor:
        return self.both(length, like.device)[0]


class _Gather(torch.autograd.Function):
    """Every rank's tokens of ``x`` along ``dim``, back in sequence order; backward: reduce-scatter."""

    @staticmethod
    def forward(ctx, x, dim, order, comm, counter):
        ctx.args = (dim, order, comm, counter)
        counter.received += (comm.size - 1) * x.numel() * x.element_size()  # every other rank's tokens
        parts = comm.all_gather(x.contiguous())
        arrived = torch.cat(parts, dim)
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=order.device)
        return arrived.index_select(dim, inverse)

    @staticmethod
    def backward(ctx, grad):
        dim, order, comm, counter = ctx.args
        arranged = grad.index_select(dim, order)  # rank 0's tokens first, as they arrived
        pieces = list(arranged.chunk(comm.size, dim))
        counter.received += (comm.size - 1) * pieces[0].numel() * pieces[0].element_size()  # others' shares
        return comm.reduce_scatter(pieces), None, None, None, None


class Gather(nn.Module):
    """A split value made whole (all-gather forward, reduce-scatter backward): keys and values before attention,
    and the input of an op that reads across positions."""

    def __init__(self, comm: Communicator, positions: Positions, dim: int, inner: int | None = None):
        super().__init__()
        self.comm, self.positions, self.dim, self.inner = comm, positions, dim, inner
        """``inner``: where ``dim`` merges the sequence with others (GPT-2's ``[B*T, C]``), the positions after the
        sequence in it (``passes.sequence_merge``); the dim is unflattened around the sequence to gather it."""
        self.received = 0
        """Bytes this rank has received through this gather (forward all-gathers and backward reduce-scatters,
        counted as a ring moves them: every other rank's part once)."""

    def forward(self, x: torch.Tensor, length) -> torch.Tensor:
        mine, order = self.positions.both(length, x.device)
        if self.inner is None:
            return _Gather.apply(x, self.dim, order, self.comm, self)
        x = x.unflatten(self.dim, (-1, mine.numel(), self.inner))
        return _Gather.apply(x, self.dim + 1, order, self.comm, self).flatten(self.dim, self.dim + 2)


class _Scaled(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, by):
        ctx.by = by
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.by, None


class OutputShare(nn.Module):
    """A whole output: identity forward; backward, this rank's share (``1/cp``) of the gradient (every rank
    computes the same loss on it, and the shares are summed where they meet a gather or a parameter)."""

    def __init__(self, cp: int):
        super().__init__()
        self.cp = cp

    def forward(self, x):
        return _Scaled.apply(x, 1.0 / self.cp) if isinstance(x, torch.Tensor) and x.requires_grad else x


class ParamGradSum(CopyToTP):
    """A parameter's read: identity forward; backward, the gradient summed over the cp ranks (each computed its
    tokens' part), so every rank holds the whole gradient, as the unsharded model does: Megatron's ``f`` over
    the cp ranks, skipped where no gradient flows."""

    def forward(self, x):
        return super().forward(x) if x.requires_grad and torch.is_grad_enabled() else x


def causal_rows(positions: torch.Tensor, length: int) -> torch.Tensor:
    """The causal mask of this rank's query rows over all ``length`` keys (True: may attend)."""
    return positions[:, None] >= torch.arange(int(length), device=positions.device)[None, :]


def trained_scale(scale) -> None:
    """Refuse a scale the model trains (a learnt temperature): the ring and Ulysses take the scores' scale as a
    number, through which no gradient would flow."""
    if isinstance(scale, torch.Tensor) and scale.requires_grad:
        raise InputError("an attention's scale needs a gradient (a trained temperature), which the ring and Ulysses "
                         "exchanges do not carry; use cp_exchange='all_gather'")
