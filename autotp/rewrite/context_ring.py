"""Ring attention over the cp ranks: each rank's queries meet every rank's key/value block in turn, the blocks
passed around the ring (each rank sends to the next and receives from the previous, the next block's transfer
overlapping this block's compute), every block's attention merged into running softmax statistics. No rank ever
holds more than two blocks of keys and values, nor saves any but its own for backward.

The statistics are the running row maximum ``m`` and sum ``l`` (not their log-sum-exp): a row every key of which
is masked by a large finite negative (transformers' float masks) then averages the values exactly as the
unsharded softmax does, and a row no key of which may be seen (a boolean mask) gives zeros, as torch's does.

Backward recomputes each block's probabilities from the log-sum-exp ``m + log l`` (flash attention's backward:
a row a float mask masks whole gets the gradients torch's SDPA kernel gives it; for an explicit softmax, from
``exp(s - m) / l``, softmax's own gradient, uniform over such a row's keys) and passes the
blocks around again, the key/value gradients travelling with them and arriving home after ``cp - 1`` steps.
Causal attention (``is_causal``) skips the chunk pairs whose keys all follow the queries (with the load-balanced
chunks, about half the pairs); a boolean mask skips the chunk pairs it masks whole.
"""

from __future__ import annotations

import torch
from torch import nn

from autotp.errors import InputError
from autotp.rewrite.comm import Communicator
from autotp.rewrite.context_ops import Positions, trained_scale


class _Geometry:
    """What every block of one call needs: the ranks' positions (2 chunks each), the mask, and how to score."""

    def __init__(self, comm, positions, mask, causal, scale, n_rep):
        self.comm, self.positions, self.mask, self.causal = comm, positions, mask, causal
        self.scale, self.n_rep = scale, n_rep
        self.chunk = positions.shape[1] // 2

    def pairs(self, source: int):
        """The (query chunk, key chunk) pairs of this rank's queries against ``source``'s keys that any query
        may see: (query rows, key columns) slices and the boolean/float mask of the pair (or None)."""
        me, c = self.positions[self.comm.rank], self.chunk
        theirs = self.positions[source]
        for qc in range(2):
            rows = slice(qc * c, (qc + 1) * c)
            for kc in range(2):
                cols = slice(kc * c, (kc + 1) * c)
                if self.causal:
                    if theirs[cols][0] > me[rows][-1]:
                        continue  # every key of this chunk follows every query of that one
                    yield rows, cols, me[rows][:, None] >= theirs[cols][None, :]
                elif self.mask is None:
                    yield rows, cols, None
                else:
                    mine = self.mask if self.mask.shape[-2] == 1 else self.mask[..., rows, :]  # rows broadcast
                    block = mine.index_select(-1, theirs[cols])
                    if block.dtype == torch.bool and not bool(block.any()):
                        continue
                    yield rows, cols, block

    def scores(self, q, k, mask):
        """``q k^T * scale`` with the mask applied (keys repeated for grouped-query attention)."""
        s = torch.matmul(q, _repeat(k, self.n_rep).transpose(-1, -2)) * self.scale
        if mask is None:
            return s
        if mask.dtype == torch.bool:
            return s.masked_fill(~mask, float("-inf"))
        return s + mask


def _repeat(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """transformers' ``repeat_kv``: each KV head repeated for the query heads that share it."""
    return x if n_rep == 1 else x.repeat_interleave(n_rep, dim=1)


def _fold(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """The transpose of ``_repeat``: the query heads' gradients summed onto their KV head."""
    if n_rep == 1:
        return x
    b, h, *rest = x.shape
    return x.view(b, h // n_rep, n_rep, *rest).sum(2)


def _safe(m: torch.Tensor) -> torch.Tensor:
    """The running maximum where finite, else 0 (a row nothing has been seen by yet)."""
    return torch.where(torch.isfinite(m), m, torch.zeros_like(m))


def _forward_block(geo, q, kv, source, state):
    """Merge ``source``'s block ``kv`` into the running (m, l, acc) of ``q``'s rows."""
    m, l, acc = state
    k, v = kv[0], kv[1]
    for rows, cols, mask in geo.pairs(source):
        s = geo.scores(q[..., rows, :], k[..., cols, :], mask)
        m_new = torch.maximum(m[..., rows, :], s.amax(-1, keepdim=True))
        safe = _safe(m_new)
        p = torch.exp(s - safe)
        keep = torch.exp(m[..., rows, :] - safe)
        l[..., rows, :] = l[..., rows, :] * keep + p.sum(-1, keepdim=True)
        acc[..., rows, :] = acc[..., rows, :] * keep + torch.matmul(p, _repeat(v[..., cols, :], geo.n_rep))
        m[..., rows, :] = m_new


def _backward_block(geo, q, kv, source, saved, dq, dkv):
    """Add ``source``'s block's share of the gradients: into ``dq`` (this rank's queries) and ``dkv`` (the
    block's keys and values, wherever they live now)."""
    out, (shift, norm), grad, delta = saved
    k, v = kv[0], kv[1]
    for rows, cols, mask in geo.pairs(source):
        s = geo.scores(q[..., rows, :], k[..., cols, :], mask)
        p = torch.exp(s - shift[..., rows, :])
        p = p if norm is None else p / norm[..., rows, :]
        g = grad[..., rows, :]
        dkv[1][..., cols, :] += _fold(torch.matmul(p.transpose(-1, -2), g), geo.n_rep)
        dp = torch.matmul(g, _repeat(v[..., cols, :], geo.n_rep).transpose(-1, -2))
        ds = p * (dp - delta[..., rows, :]) * geo.scale
        dq[..., rows, :] += torch.matmul(ds, _repeat(k[..., cols, :], geo.n_rep))
        dkv[0][..., cols, :] += _fold(torch.matmul(ds.transpose(-1, -2), q[..., rows, :]), geo.n_rep)


class _Ring(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, mask, geo, counter):
        comm, rank = geo.comm, geo.comm.rank
        kv = torch.stack([k, v])
        m = q.new_full((*q.shape[:-1], 1), float("-inf"))
        state = (m, torch.zeros_like(m), torch.zeros_like(q))
        for step in range(comm.size):
            arriving = comm.ring_shift_started(kv) if step < comm.size - 1 else None
            _forward_block(geo, q, kv, (rank - step) % comm.size, state)
            if arriving is not None:
                counter.received += kv.numel() * kv.element_size()
                kv = arriving()
        m, l, acc = state
        out = acc / torch.where(l > 0, l, torch.ones_like(l))
        ctx.geo, ctx.counter = geo, counter
        ctx.save_for_backward(q, k, v, out, m, l, mask)  # the mask too, so that what is saved is counted
        geo.mask = None
        return out

    @staticmethod
    def backward(ctx, grad):
        geo, counter = ctx.geo, ctx.counter
        q, k, v, out, m, l, geo.mask = ctx.saved_tensors
        comm, rank, size = geo.comm, geo.comm.rank, geo.comm.size
        grad = grad.contiguous()
        # Probabilities from the log-sum-exp, as flash attention's backward (torch's CPU kernel) takes them: a
        # row whose every key a float mask masks then gets the gradients the unsharded SDPA gives it.
        if geo.explicit:  # softmax's own gradient: a row masked whole by a float mask is uniform over its keys
            stats = (_safe(m), torch.where(l > 0, l, torch.ones_like(l)))
        else:
            stats = (torch.where(l > 0, _safe(m) + torch.log(l), torch.full_like(l, float("inf"))), None)
        saved = (out, stats, grad, (grad * out).sum(-1, keepdim=True))
        dq, kv = torch.zeros_like(q), torch.stack([k, v])
        home = torch.zeros_like(kv)  # this rank's own block's gradient, computed here
        arriving = comm.ring_shift_started(kv) if size > 1 else None
        _backward_block(geo, q, kv, rank, saved, dq, home)
        passed = None  # the travelling gradient of the block held, on its way home
        for step in range(1, size):
            counter.received += kv.numel() * kv.element_size()
            kv = arriving()
            arriving = comm.ring_shift_started(kv) if step < size - 1 else None
            dkv = passed() if passed is not None else torch.zeros_like(kv)
            if passed is not None:
                counter.received += dkv.numel() * dkv.element_size()
            _backward_block(geo, q, kv, (rank - step) % size, saved, dq, dkv)
            passed = comm.ring_shift_started(dkv)
        if passed is not None:
            arrived = passed()
            counter.received += arrived.numel() * arrived.element_size()
            home = home + arrived
        return dq, home[0], home[1], None, None, None


class RingAttention(nn.Module):
    """SDPA on this rank's queries over every rank's keys and values, by ring exchange (the module docstring).

    Called with this rank's ``q`` ``[B, H, t, D]`` and its own ``k``, ``v`` ``[B, Hkv, t, D]`` (KV heads, before
    any repeat), the mask's rows of this rank's queries over all keys (``[..., t, T]``, or None), and the whole
    length ``T``."""

    def __init__(self, comm: Communicator, positions: Positions, causal: bool, scale: float | None, n_rep: int,
                 explicit: bool = False):
        super().__init__()
        self.comm, self.positions, self.causal, self.scale, self.n_rep = comm, positions, causal, scale, n_rep
        self.explicit = explicit
        """Whether it stands for an explicit ``softmax(QK^T)V`` (its gradients are softmax's, not SDPA's kernel's)."""
        self.received = 0
        """Bytes this rank has received: the key/value blocks (forward and backward) and their gradients."""

    def forward(self, q, k, v, mask, length, scale=None):
        """(``scale``: a 0-dim tensor the scores are multiplied by, where the model computes it at run time.)"""
        if mask is not None and mask.requires_grad:
            raise InputError("ring exchange (cp_exchange='ring') takes an attention mask that needs no gradient; "
                             "this model's mask is trained: use cp_exchange='all_gather'")
        table = self._table(length, q.device)
        trained_scale(scale)
        scale = float(scale) if scale is not None else self.scale if self.scale is not None else q.shape[-1] ** -0.5
        geo = _Geometry(self.comm, table, mask, self.causal, scale, self.n_rep)
        geo.explicit = self.explicit
        return _Ring.apply(q, k.contiguous(), v.contiguous(), mask, geo, self)

    def _table(self, length, device) -> torch.Tensor:
        """Every rank's positions, one row a rank."""
        _, order = self.positions.both(length, device)
        return order.view(self.comm.size, -1)
