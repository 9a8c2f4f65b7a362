"""More sharding structures, one tiny hand-written module each, checked at tp=2 in one process.

As in ``test_structures_unit``: each test asserts that one training step matches the unsharded model and
that the structure's parameters are split.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import autotp

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


class PreProjection(nn.Module):
    """A projection from a narrow embedding into the residual stream (ELECTRA, ALBERT), then an MLP."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(32, D // 2)
        self.project = nn.Linear(D // 2, D)
        self.norm = nn.LayerNorm(D)
        self.up, self.down = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)

    def forward(self, ids):
        h = self.norm(self.project(self.embed(ids)))
        return h + self.down(torch.relu(self.up(h)))


def test_lone_projection_between_whole_values_is_row_split():
    report = _check(_model(PreProjection), torch.randint(0, 32, (B, T)))
    _split(report, "project.weight", "up.weight", "down.weight")
    assert "row" in [r.kind.value for r in report.plan.regions]


class TimeStep(nn.Module):
    """A per-head time step computed from V's split features (Doge): row-split, all-reduced, taken per head."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(D, D) for _ in range(4))
        self.dt = nn.Linear(D, H)

    def forward(self, x):
        b, t, _ = x.shape
        v = self.v(x)
        q, k, vh = (z.view(b, t, H, HD).transpose(1, 2) for z in (self.q(x), self.k(x), v))
        mask = torch.nn.functional.softplus(self.dt(v)).transpose(1, 2)[:, :, None, :]  # [b, H, 1, t]
        y = torch.nn.functional.scaled_dot_product_attention(q, k, vh, attn_mask=-mask.expand(b, H, t, t))
        return self.o(y.transpose(1, 2).reshape(b, t, D))


def test_value_made_by_a_row_of_the_region_is_sliced_per_head():
    report = _check(_model(TimeStep), _x(B, T, D))
    _split(report, "q.weight", "v.weight", "dt.weight", "o.weight")


class Router(nn.Module):
    """A top-2 router in float32 over experts (its weight cast, as many MoE models do)."""

    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(D, 8, bias=False)
        self.experts = nn.ModuleList(nn.Linear(D, D) for _ in range(8))

    def forward(self, x):
        weights, chosen = torch.nn.functional.linear(x.float(), self.gate.weight.float()).softmax(-1).topk(2, -1)
        out = torch.stack([e(x) for e in self.experts], -2)  # [b, t, experts, D]
        picked = out.gather(-2, chosen[..., None].expand(*chosen.shape, D))
        return (weights[..., None] * picked).sum(-2)


def test_router_kept_whole_by_choice():
    report = _check(_model(Router), _x(B, T, D))
    assert not report.plan.placements["gate.weight"].is_split
    assert "gate.weight" in report.plan.by_choice  # a functional linear: named by its parameter
    assert any("router" in n for n in report.plan.notes)


class InPlaceMaskedScores(nn.Module):
    """Megatron-core's attention: scores masked in place (``masked_fill_``) by a whole causal mask, then softmax."""

    def __init__(self):
        super().__init__()
        self.qkv, self.o = nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.register_buffer("mask", torch.triu(torch.ones(1, 1, T, T, dtype=torch.bool), diagonal=1))

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (p.view(b, t, H, HD).transpose(1, 2) for p in self.qkv(x).split(D, -1))
        scores = q @ k.transpose(-1, -2) / HD ** 0.5
        scores.masked_fill_(self.mask[..., :t, :t], -10000.0)  # in place on a value split by heads
        return self.o((scores.softmax(-1) @ v).transpose(1, 2).reshape(b, t, D))


def test_an_in_place_op_on_a_split_value_splits_as_its_functional_form():
    report = _check(_model(InPlaceMaskedScores), _x(B, T, D))
    _split(report, "qkv.weight", "o.weight")


class LowRankAttention(nn.Module):
    """DeepSeek's multi-head latent attention: Q and K/V pass through narrow latents (a down-projection, a norm,
    an up-projection per head); a rotary key part shared by every head is expanded over them, and the keys are
    filled into a ``new_empty`` by slices."""

    LATENT = 8

    def __init__(self):
        super().__init__()
        self.q_a, self.q_norm = nn.Linear(D, self.LATENT), nn.RMSNorm(self.LATENT)
        self.q_b = nn.Linear(self.LATENT, H * 2 * HD)
        self.kv_a, self.kv_norm = nn.Linear(D, self.LATENT + HD), nn.RMSNorm(self.LATENT)
        self.kv_b = nn.Linear(self.LATENT, H * 2 * HD)  # per head: its own key part, then its value
        self.o = nn.Linear(H * HD, D)

    def forward(self, x):
        b, t, _ = x.shape
        q = self.q_b(self.q_norm(self.q_a(x))).view(b, t, H, 2 * HD).transpose(1, 2)
        latent, shared = self.kv_a(x).split([self.LATENT, HD], -1)
        own, v = self.kv_b(self.kv_norm(latent)).view(b, t, H, 2 * HD).transpose(1, 2).split([HD, HD], -1)
        k = own.new_empty(b, H, t, 2 * HD)
        k[..., :HD] = own
        k[..., HD:] = shared.view(b, 1, t, HD).expand(-1, H, -1, -1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, t, H * HD))


def test_low_rank_attention_splits_its_up_projections_by_heads():
    report = _check(_model(LowRankAttention), _x(B, T, D))
    kinds = {name: p.kind.value for name, p in report.plan.placements.items()}
    assert kinds["q_b.weight"] == kinds["kv_b.weight"] == "colwise", kinds  # not the narrow latents
    assert kinds["o.weight"] == "rowwise", kinds
    _split(report, "q_a.weight", "kv_a.weight")  # the down-projections split alone, by their input


class CopyIntoWhole(nn.Module):
    """A split value copied into a whole buffer: the buffer stays whole, so the value is gathered first."""

    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(D, 2 * D), nn.Linear(2 * D, D)

    def forward(self, x):
        h = self.up(x)
        buffer = torch.zeros(*x.shape[:-1], 3 * D)
        buffer[..., D:] = h
        return self.down(h) + buffer.sum(-1, keepdim=True)


def test_a_split_value_copied_into_a_whole_buffer_is_exact():
    _check(_model(CopyIntoWhole), _x(B, T, D))


class NoGradIndexer(nn.Module):
    """A sparse-attention indexer (DeepSeek V3.2): under ``torch.no_grad()``, per-head scores of its own
    projections, weighted and summed over the heads, pick the keys each query may attend to (a top-k mask).
    As in dots3, it casts its input to the dtype it has: that returns the same tensor, which torch.export then
    hands out of the no-grad part for every later reader (the per-head gate)."""

    def __init__(self):
        super().__init__()
        self.index_q, self.index_k, self.index_w = nn.Linear(D, H * HD), nn.Linear(D, HD), nn.Linear(D, H)
        self.q, self.k, self.v, self.o = (nn.Linear(D, D) for _ in range(4))
        self.gate, self.norm = nn.Linear(D, H), nn.RMSNorm(D)

    def forward(self, x):
        b, t, _ = x.shape
        h = self.norm(x)  # its weight's gradient comes through every reader of h
        with torch.no_grad():
            xi = F.rms_norm(h, (D,))
            q = self.index_q(xi).view(b, t, H, HD)
            scores = torch.matmul(q, self.index_k(xi).unsqueeze(1).transpose(-1, -2)).relu()  # [b, t, H, t]
            weights = self.index_w(h.to(torch.float32))
            index = torch.matmul(weights.unsqueeze(-2), scores).squeeze(-2)  # summed over heads
            keep = index.topk(t // 2, dim=-1).indices
            mask = torch.full((b, t, t), float("-inf")).scatter(-1, keep, 0.0)
            scale = index.amax(-1, keepdim=True).sigmoid()  # differentiable in index_*, were gradients on
        y = F.scaled_dot_product_attention(*(p(h).view(b, t, H, HD).transpose(1, 2) for p in (self.q, self.k, self.v)),
                                           attn_mask=mask.unsqueeze(1))
        y = y * self.gate(h).sigmoid().transpose(1, 2).unsqueeze(-1)
        return self.o(y.transpose(1, 2).reshape(b, t, D)) * scale


def test_a_no_grad_part_reading_parameters_is_split_and_stays_without_gradients():
    model = _model(NoGradIndexer)
    report = _check(model, _x(B, T, D))
    _split(report, "index_q.weight", "index_w.weight", "q.weight", "gate.weight", "o.weight")
    pm = autotp.parallelize(model, tp=1, example_inputs=_x(B, T, D))
    pm(_x(B, T, D)).sum().backward()
    grads = {name: p.grad for name, p in pm.named_parameters()}
    assert all(grads[name] is None for name in grads if "index_" in name), grads.keys()
    assert all(grads[name] is not None for name in grads if "index_" not in name), grads


class ComputedSplitSizes(nn.Module):
    """A fused gate and up projection cut by a size the graph computes from the input's shape (FocalNet reads
    its channel count off a symbolic shape): each rank divides the computed size where the split reads it."""

    def __init__(self, as_list: bool):
        super().__init__()
        self.as_list = as_list
        self.gate_up, self.down = nn.Linear(D, 4 * D), nn.Linear(2 * D, D)

    def forward(self, x):
        width = 2 * D * T // x.shape[1]  # 2 * D, but a graph value: the sequence length stays dynamic
        sizes = [width, width] if self.as_list else width
        gate, up = torch.split(self.gate_up(x), sizes, dim=-1)
        return self.down(F.silu(gate) * up)


@pytest.mark.parametrize("as_list", [True, False], ids=["split_with_sizes", "split"])
def test_split_sizes_computed_in_the_graph_are_divided_per_rank(as_list):
    report = _check(_model(ComputedSplitSizes, as_list), _x(B, T, D))
    _split(report, "gate_up.weight", "down.weight")


class PackedCrossAttention(nn.Module):
    """``nn.MultiheadAttention`` as a decoder's cross-attention: one packed ``in_proj_weight`` whose slices project
    the queries (from ``x``) and the keys and values (from ``memory``), as torch slices it (``w.split([E, 2E])``
    when key is value, ``w.chunk(3)`` otherwise)."""

    def __init__(self, key_is_value: bool):
        super().__init__()
        self.key_is_value = key_is_value
        self.attn = nn.MultiheadAttention(D, H, batch_first=True)
        self.up, self.down = nn.Linear(D, 2 * D), nn.Linear(2 * D, D)

    def forward(self, x, memory):
        if memory.shape[0] != x.shape[0]:  # as nn.Transformer checks: one batch size, not two (a capture fact)
            raise ValueError("x and memory must have the same batch size")
        value = memory if self.key_is_value else memory.flip(1)
        x = x + self.attn(x, memory, value, need_weights=False)[0]
        return x + self.down(F.gelu(self.up(x)))


@pytest.mark.parametrize("key_is_value", [True, False])
def test_packed_cross_attention_is_split_by_heads_in_every_slice(key_is_value):
    report = _check(_model(PackedCrossAttention, key_is_value), _x(B, T, D), _x(B, 5, D, seed=1))
    _split(report, "attn.in_proj_weight", "attn.in_proj_bias", "attn.out_proj.weight")
    assert report.plan.placements["attn.in_proj_weight"].segments == (D, D, D)


class JoinedBiasAttention(nn.Module):
    """BEiT's attention: a fused QKV projection whose bias is ``cat(q_bias, zeros, v_bias)``, parameters around a
    buffer of zeros for the keys."""

    def __init__(self):
        super().__init__()
        self.qkv, self.o = nn.Linear(D, 3 * D, bias=False), nn.Linear(D, D)
        self.q_bias, self.v_bias = nn.Parameter(0.1 * torch.randn(D)), nn.Parameter(0.1 * torch.randn(D))
        self.register_buffer("k_bias", torch.zeros(D), persistent=False)

    def forward(self, x):
        b, t, _ = x.shape
        qkv = F.linear(x, self.qkv.weight, torch.cat((self.q_bias, self.k_bias, self.v_bias)))
        q, k, v = qkv.reshape(b, t, 3, H, HD).permute(2, 0, 3, 1, 4).unbind(0)
        return x + self.o(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, t, D))


def test_a_bias_joined_from_parameters_and_a_buffer_is_split_with_the_heads():
    report = _check(_model(JoinedBiasAttention), _x(B, T, D))
    _split(report, "qkv.weight", "q_bias", "v_bias", "o.weight")
    assert report.plan.placements["qkv.weight"].segments == (D, D, D)
