"""Ulysses attention over the cp ranks (DeepSpeed-Ulysses): an all-to-all turns this rank's tokens of every head
into every token of ``1/cp`` of the heads, attention runs over the whole sequence on those heads (the whole mask,
``is_causal`` as it was), and a second all-to-all turns the output back into this rank's tokens of every head.

Needs ``cp`` to divide the KV heads (and so the query heads): query head group ``g`` then meets exactly KV head
group ``g``. Each all-to-all's backward is the all-to-all the other way.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from autotp.rewrite.comm import Communicator
from autotp.rewrite.context_ops import Positions, trained_scale


class _AllToAll(torch.autograd.Function):
    """``x`` cut in ``cp`` pieces along ``split``, piece ``r`` sent to rank ``r``, the pieces received
    concatenated along ``join`` in rank order; backward: the same the other way."""

    @staticmethod
    def forward(ctx, x, split, join, comm, counter):
        ctx.args = (split, join, comm, counter)
        return _exchange(x, split, join, comm, counter)

    @staticmethod
    def backward(ctx, grad):
        split, join, comm, counter = ctx.args
        return _exchange(grad, join, split, comm, counter), None, None, None, None


def _exchange(x, split, join, comm, counter):
    pieces = [p.contiguous() for p in x.chunk(comm.size, split)]
    counter.received += (comm.size - 1) * pieces[0].numel() * pieces[0].element_size()
    # Equal pieces as rows of one flat tensor: the variable-size all-to-all with every count the same.
    n = pieces[0].numel()
    got = comm.all_to_all(torch.cat([p.reshape(-1) for p in pieces]), [n] * comm.size, [n] * comm.size)
    return torch.cat([g.view(pieces[0].shape) for g in got.split(n)], join)


class UlyssesAttention(nn.Module):
    """SDPA on this rank's queries, by all-to-all between sequence and heads (the module docstring).

    Called with this rank's ``q`` ``[B, H, t, D]``, ``k``, ``v`` ``[B, Hkv, t, D]`` (before any repeat), the
    whole mask (``[..., T, T]``, or None) and the whole length ``T``."""

    def __init__(self, comm: Communicator, positions: Positions, causal: bool, scale: float | None, n_rep: int,
                 explicit: bool = False):
        super().__init__()
        self.comm, self.positions, self.causal, self.scale, self.n_rep = comm, positions, causal, scale, n_rep
        self.explicit = explicit
        """Whether it stands for an explicit ``softmax(QK^T)V``: computed so on this rank's heads, with softmax's
        gradients (SDPA's kernel differs on a row a float mask masks whole)."""
        self.received = 0
        """Bytes this rank has received through its all-to-alls (forward and backward)."""

    def to_heads(self, x, inverse):
        """This rank's tokens of every head -> every token (in sequence order) of this rank's heads."""
        return _AllToAll.apply(x, 1, 2, self.comm, self).index_select(2, inverse)

    def forward(self, q, k, v, mask, length, scale=None):
        """(``scale``: a 0-dim tensor the scores are multiplied by, where the model computes it at run time.)"""
        _, order = self.positions.both(length, q.device)
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=order.device)
        q, k, v = (self.to_heads(x, inverse) for x in (q, k, v))
        if self.n_rep > 1:
            k, v = k.repeat_interleave(self.n_rep, dim=1), v.repeat_interleave(self.n_rep, dim=1)
        if mask is not None and mask.dim() >= 3 and mask.shape[-3] > 1:  # a mask per head: this rank's heads
            heads = mask.shape[-3] // self.comm.size
            mask = mask.narrow(-3, self.comm.rank * heads, heads)
        trained_scale(scale)
        scale = float(scale) if scale is not None else self.scale
        if self.explicit:
            out = _explicit(q, k, v, mask, scale if scale is not None else q.shape[-1] ** -0.5)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=self.causal, scale=scale)
        return _AllToAll.apply(out.index_select(2, order), 2, 1, self.comm, self)


def _explicit(q, k, v, mask, scale: float):
    """``softmax(q k^T * scale + mask) v`` as the model writes it (a boolean mask: True where a key may be seen)."""
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask
    return torch.matmul(s.softmax(-1), v)
