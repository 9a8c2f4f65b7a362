"""Structures from the zoo's rows that were not exact (issue 25), one tiny hand-written module each, checked at
tp=2 and tp=4 in one process (``autotp.check``): one training step matches the unsharded model, and the
structure's parameters are split."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.test_structures_unit import HD, B, D, H, T, _check, _model, _split, _x


class HeadParameters(nn.Module):
    """XLNet's attention: Q/K/V/O are raw ``[model, heads, head_dim]`` parameters used by einsum
    (``"ibh,hnd->ibnd"`` in, ``"ibnd,hnd->ibh"`` out), a per-head bias added to Q, and the scores shifted along
    the key positions with ``index_select`` (its relative shift)."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Parameter(torch.randn(D, H, HD) / D ** 0.5) for _ in range(4))
        self.bias = nn.Parameter(torch.randn(H, HD) / HD)

    def forward(self, x):  # [T, B, D]: XLNet's sequence-first layout
        q = torch.einsum("ibh,hnd->ibnd", x, self.q) + self.bias
        k, v = (torch.einsum("ibh,hnd->ibnd", x, w) for w in (self.k, self.v))
        scores = torch.einsum("ibnd,jbnd->bnij", q, k)
        scores = scores.index_select(3, torch.arange(scores.shape[3] - 1, -1, -1))  # keys in another order
        y = torch.einsum("bnij,jbnd->ibnd", scores.softmax(-1), v)
        return x + torch.einsum("ibnd,hnd->ibh", y, self.o)


@pytest.mark.parametrize("tp", [2, 4])
def test_head_parameters_used_by_einsum_split_by_heads(tp):
    report = _check(_model(HeadParameters), _x(T, B, D), tp=tp)
    _split(report, "q", "k", "v", "o", "bias")
    assert {report.plan.placements[n].kind.value for n in ("q", "k", "v")} == {"colwise"}
    assert report.plan.placements["o"].kind.value == "rowwise"
