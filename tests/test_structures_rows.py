"""Structures from the zoo's rows that were not exact (issue 25), one tiny hand-written module each, checked at
tp=2 and tp=4 in one process (``autotp.check``): one training step matches the unsharded model, and the
structure's parameters are split."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
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


E = 4  # experts


class ExpertBank(nn.Module):
    """JetMoE's experts: a ``[experts, out, in]`` bank used one matrix at a time (``F.linear(x_e, W[e])``) on each
    expert's tokens, the outputs concatenated, then cut into gate and up halves; the results put back in token
    order with ``index_add``."""

    def __init__(self):
        super().__init__()
        self.up = nn.Parameter(torch.randn(E, 4 * D, D) / D ** 0.5)
        self.down = nn.Parameter(torch.randn(E, D, 2 * D) / D ** 0.5)

    def forward(self, x):  # [N, D], N a multiple of E: each expert takes N / E tokens
        order = torch.arange(x.shape[0]).flip(0)  # the tokens grouped by expert (a fixed routing here)
        parts = x[order].split(x.shape[0] // E)
        gate, up = torch.cat([F.linear(p, self.up[e]) for e, p in enumerate(parts)]).chunk(2, dim=-1)
        hidden = (F.silu(gate) * up).split(x.shape[0] // E)
        out = torch.cat([F.linear(h, self.down[e]) for e, h in enumerate(hidden)])
        return x + torch.zeros_like(x).index_add(0, order, out)


@pytest.mark.parametrize("tp", [2, 4])
def test_an_expert_bank_used_per_expert_splits_like_a_projection(tp):
    report = _check(_model(ExpertBank), _x(2 * E, D), tp=tp)
    _split(report, "up", "down")
    assert (report.plan.placements["up"].dim, report.plan.placements["down"].dim) == (1, 2)


class SingleKVHead(nn.Module):
    """Multi-query attention whose one K/V head is repeated to every query head (``expand`` then ``reshape``), its
    projection reading another tensor than Q's (DeepSeek-V4: Q from a low-rank ``q_b``, K = V from ``kv``), and
    a grouped output projection, one block of its weight per group of heads, used through ``view`` and ``bmm``."""

    GROUPS = 2

    def __init__(self):
        super().__init__()
        self.q_a, self.q_b, self.kv = nn.Linear(D, D // 2), nn.Linear(D // 2, D), nn.Linear(D, HD)
        self.o_a = nn.Parameter(torch.randn(self.GROUPS * D, D // self.GROUPS) / D ** 0.5)
        self.o_b = nn.Linear(self.GROUPS * D, D)

    def forward(self, x):
        b, t, _ = x.shape
        q = self.q_b(torch.relu(self.q_a(x))).view(b, t, H, HD).transpose(1, 2)
        kv = self.kv(x)[:, None].expand(b, H, t, HD).reshape(b, H, t, HD)
        y = F.scaled_dot_product_attention(q, kv, kv, is_causal=True)
        grouped = y.transpose(1, 2).reshape(b * t, self.GROUPS, D // self.GROUPS).transpose(0, 1)
        w = self.o_a.view(self.GROUPS, D, D // self.GROUPS).transpose(1, 2)
        mixed = torch.bmm(grouped, w).transpose(0, 1).reshape(b, t, self.GROUPS * D)
        return x + self.o_b(mixed)


@pytest.mark.parametrize("tp", [2])
def test_a_single_kv_head_repeated_to_split_query_heads_closes_the_region(tp):
    report = _check(_model(SingleKVHead), _x(B, T, D), tp=tp)
    _split(report, "q_b.weight", "o_a", "o_b.weight")
    assert report.plan.placements["o_b.weight"].kind.value == "rowwise"


class SharedHeadBias(nn.Module):
    """CPM-Ant's relative-position bias: one ``[buckets, heads]`` parameter table looked up once and added to the
    scores of every layer, each layer's scores computed as ``q @ k.transpose(-1, -2)``: splitting the table by
    heads splits every layer that reads it, together."""

    BUCKETS = 8

    def __init__(self):
        super().__init__()
        self.table = nn.Parameter(torch.randn(self.BUCKETS, H))
        self.layers = nn.ModuleList(nn.ModuleList(nn.Linear(D, D, bias=False) for _ in range(4)) for _ in range(2))

    def forward(self, x):
        b, t, _ = x.shape
        buckets = (torch.arange(t)[:, None] - torch.arange(t)[None, :]).abs().clamp(max=self.BUCKETS - 1)
        bias = F.embedding(buckets, self.table).permute(2, 0, 1)[None]  # [1, H, t, t]
        for q, k, v, o in self.layers:
            qh, kh, vh = (p(x).view(b, t, H, HD).transpose(1, 2) for p in (q, k, v))
            scores = (qh @ kh.transpose(-1, -2)) / HD ** 0.5 + bias
            x = x + o((scores.softmax(-1) @ vh).transpose(1, 2).reshape(b, t, D))
        return x


@pytest.mark.parametrize("tp", [2, 4])
def test_a_per_head_bias_shared_by_layers_splits_with_every_layer(tp):
    report = _check(_model(SharedHeadBias), _x(B, T, D), tp=tp)
    _split(report, "table", *(f"layers.{i}.{j}.weight" for i in range(2) for j in range(4)))


class EntropyPatches(nn.Module):
    """BLT's patcher: a distribution built on a projection's logits (``Categorical(logits=...).entropy()``), whose
    argument validation is a data-dependent check that capture skips (it computes nothing the forward uses)."""

    def __init__(self):
        super().__init__()
        self.up, self.down, self.logits = nn.Linear(D, 4 * D), nn.Linear(4 * D, D), nn.Linear(D, D)

    def forward(self, x):
        x = x + self.down(torch.relu(self.up(x)))
        entropy = torch.distributions.Categorical(logits=self.logits(x)).entropy()
        return x * entropy[..., None]


@pytest.mark.parametrize("tp", [2, 4])
def test_a_distributions_argument_check_does_not_stop_capture(tp):
    validating = torch.distributions.Distribution._validate_args
    report = _check(_model(EntropyPatches), _x(B, T, D), tp=tp)
    _split(report, "up.weight", "down.weight")
    assert torch.distributions.Distribution._validate_args == validating  # the user's default is left as it was


class RepeatedKV(nn.Module):
    """JetMoE's attention experts: each token's query made once per expert chosen (a block of H heads per copy),
    and one fused K/V projection of H heads (cut with ``chunk``), repeated once per block with ``repeat``: each rank
    takes its heads of every block, and K/V split by heads arrive as the same slices (blocks of the repeat,
    segments of Q)."""

    K = 2  # experts chosen per token

    def __init__(self):
        super().__init__()
        self.q, self.kv, self.o = nn.Linear(D, D), nn.Linear(D, 2 * D), nn.Linear(self.K * D, D)
        self.experts = nn.Parameter(torch.randn(self.K, D) / D)  # each copy's own offset

    def forward(self, x):
        b, t, _ = x.shape
        q = self.q(x[:, :, None] + self.experts).view(b, t, self.K * H, HD).transpose(1, 2)
        k, v = (z.view(b, t, H, HD).transpose(1, 2).repeat(1, self.K, 1, 1) for z in self.kv(x).chunk(2, dim=-1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.o(y.transpose(1, 2).reshape(b, t, self.K * D))


@pytest.mark.parametrize("tp", [2, 4])
def test_kv_heads_repeated_per_block_split_with_the_query_heads(tp):
    report = _check(_model(RepeatedKV), _x(B, T, D), tp=tp)
    _split(report, "q.weight", "kv.weight", "o.weight")
    kinds = {name: report.plan.placements[name].kind.value for name in ("q.weight", "kv.weight", "o.weight")}
    assert kinds == {"q.weight": "colwise", "kv.weight": "colwise", "o.weight": "rowwise"}, report.plan.notes
