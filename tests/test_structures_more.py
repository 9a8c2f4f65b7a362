"""More sharding structures, one tiny hand-written module each, checked at tp=2 in one process.

As in ``test_structures_unit``: each test asserts that one training step matches the unsharded model and
that the structure's parameters are split.
"""

from __future__ import annotations

import torch
from torch import nn

from tests.test_structures_unit import HD, B, D, H, T, _check, _model, _split, _x


class EinsumAttention(nn.Module):
    """Attention written with einsum (ProphetNet, XLNet): scores ``bhtd,bhsd->bhts``, output ``bhts,bhsd->bthd``."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(D, D) for _ in range(4))

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (p(x).view(b, t, H, HD).transpose(1, 2) for p in (self.q, self.k, self.v))
        scores = torch.einsum("bhtd,bhsd->bhts", q, k) / HD ** 0.5
        y = torch.einsum("bhts,bhsd->bthd", scores.softmax(-1), v)
        return self.o(y.reshape(b, t, D))


def test_einsum_attention_split_by_heads():
    report = _check(_model(EinsumAttention), _x(B, T, D))
    _split(report, "q.weight", "k.weight", "v.weight", "o.weight")


class EinsumContraction(nn.Module):
    """An MLP whose down projection is an einsum over the split hidden dim (a partial sum, all-reduced)."""

    def __init__(self):
        super().__init__()
        self.up = nn.Linear(D, 4 * D)
        self.down = nn.Parameter(torch.randn(4 * D, D) / D)

    def forward(self, x):
        return x + torch.einsum("btf,fd->btd", torch.relu(self.up(x)), self.down)


def test_einsum_over_the_split_dim_is_all_reduced():
    report = _check(_model(EinsumContraction), _x(B, T, D))
    _split(report, "up.weight", "down")


class BucketBias(nn.Module):
    """A relative-position bias made per head by a projection and picked per bucket with ``gather``."""

    BUCKETS = 8

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(D, D) for _ in range(4))
        self.rel = nn.Linear(D, H * self.BUCKETS)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (p(x).view(b, t, H, HD).transpose(1, 2) for p in (self.q, self.k, self.v))
        table = self.rel(x).view(b, t, H, self.BUCKETS).transpose(1, 2)  # [b, H, t, buckets]
        buckets = (torch.arange(t)[:, None] - torch.arange(t)[None, :]).abs().clamp(max=self.BUCKETS - 1)
        bias = table.gather(3, buckets.expand(b, H, t, t))
        scores = (q @ k.transpose(-1, -2)) / HD ** 0.5 + bias
        return self.o((scores.softmax(-1) @ v).transpose(1, 2).reshape(b, t, D))


def test_gathered_per_head_bias_split_with_the_heads():
    report = _check(_model(BucketBias), _x(B, T, D))
    _split(report, "q.weight", "rel.weight", "o.weight")


class HeadwiseNorm(nn.Module):
    """A per-head layer norm written with ``var(dim, unbiased, keepdim)`` (xLSTM's multi-head norm)."""

    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(D, D), nn.Linear(D, D)

    def forward(self, x):
        b, t, _ = x.shape
        h = self.up(x).view(b, t, H, HD)
        h = (h - h.mean(-1, keepdim=True)) / (torch.var(h, -1, False, True) + 1e-5).sqrt()
        return self.down(torch.nn.functional.logsigmoid(h).reshape(b, t, D))


def test_headwise_var_with_positional_keepdim():
    report = _check(_model(HeadwiseNorm), _x(B, T, D))
    _split(report, "up.weight", "down.weight")
