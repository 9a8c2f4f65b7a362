"""One tiny hand-written module per sharding structure, checked at tp=2 in one process (``autotp.check``).

Each test asserts both that one training step matches the unsharded model and that the structure's
parameters are actually split, so a structure that silently stays whole fails as surely as a wrong one.
Where a pass can be looked at alone (the reshape algebra, the projections found), it is checked too.
"""

from __future__ import annotations

import pytest
import sympy
import torch
import torch.nn.functional as F
from autotp.passes.placement import Shard
from autotp.passes.projections import find_projections
from autotp.passes.reshapes import map_reshape
from torch import nn

import autotp
from tests.graphs import captured

B, T, D, H = 2, 6, 16, 4  # batch, sequence, model width, heads
HD = D // H


def _x(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g)


def _model(cls, *args, seed=0, **kwargs):
    torch.manual_seed(seed)
    return cls(*args, **kwargs)


def _check(model, *inputs, tp=2):
    report = autotp.check(model, tp, inputs if len(inputs) > 1 else inputs[0])
    assert report.exact, f"{report}\n{report.plan}"
    return report


def _split(report, *names):
    placements = report.plan.placements
    for name in names:
        assert name in placements, f"{name} not planned; planned: {sorted(placements)}"
        assert placements[name].is_split, f"{name} kept whole: {report.plan.notes}"


def _attention(q, k, v):
    """[B, T, D] each -> heads -> causal SDPA -> [B, T, D]."""
    b, t, _ = q.shape
    q, k, v = (z.view(b, t, H, HD).transpose(1, 2) for z in (q, k, v))
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return y.transpose(1, 2).reshape(b, t, D)


# 1. Sums and means over the split dim: an RMSNorm over the whole q width (QK-norm across all heads).

class QKNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(D, D, bias=False) for _ in range(3))
        self.q_norm = nn.Parameter(1 + 0.1 * torch.randn(D))
        self.k_norm = nn.Parameter(1 + 0.1 * torch.randn(D))
        self.o = nn.Linear(D, D, bias=False)

    @staticmethod
    def _rms(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w

    def forward(self, x):
        q = self._rms(self.q(x), self.q_norm)
        k = self.k(x)
        k = k / (k.abs().sum(-1, keepdim=True) + 1) * self.k_norm  # a plain sum over the split dim
        return self.o(_attention(q, k, self.v(x)))


def test_qk_norm_sum_and_mean_over_the_split_dim():
    report = _check(_model(QKNorm), _x(B, T, D))
    _split(report, "q.weight", "k.weight", "v.weight", "o.weight", "q_norm", "k_norm")


# 2. Interleaved rotary: stack((-x2, x1), -1).flatten(-2) on the head dim.

def _rotate_every_two(x):
    x1, x2 = x[..., ::2], x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


class InterleavedRotary(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(D, D, bias=False) for _ in range(3))
        self.o = nn.Linear(D, D, bias=False)
        angles = torch.arange(T)[:, None] * 0.3 ** torch.arange(HD // 2)[None]  # [T, HD/2]
        self.register_buffer("cos", angles.cos().repeat_interleave(2, -1), persistent=False)  # [T, HD]
        self.register_buffer("sin", angles.sin().repeat_interleave(2, -1), persistent=False)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (p(x).view(b, t, H, HD).transpose(1, 2) for p in (self.q, self.k, self.v))
        q = q * self.cos + _rotate_every_two(q) * self.sin
        k = k * self.cos + _rotate_every_two(k) * self.sin
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, t, D))


def test_interleaved_rotary_stack_flatten():
    report = _check(_model(InterleavedRotary), _x(B, T, D))
    _split(report, "q.weight", "k.weight", "v.weight", "o.weight")


# 3. A strided slice on the split dim: gate and up interleaved in one fused projection.

class StridedGateUp(nn.Module):
    def __init__(self, inner=32):
        super().__init__()
        self.gate_up = nn.Linear(D, 2 * inner, bias=False)
        self.down = nn.Linear(inner, D, bias=False)

    def forward(self, x):
        h = self.gate_up(x)
        return self.down(F.silu(h[..., ::2]) * h[..., 1::2])


def test_strided_slice_of_a_fused_gate_up():
    report = _check(_model(StridedGateUp), _x(B, T, D))
    _split(report, "gate_up.weight", "down.weight")


# 4. A fused QKV projection sliced by position at segment boundaries (grouped-query sizes).

class SlicedQKV(nn.Module):
    def __init__(self, kv_heads=2, negative=False):
        super().__init__()
        self.kv, self.negative = kv_heads * HD, negative
        self.qkv = nn.Linear(D, D + 2 * self.kv, bias=True)
        self.o = nn.Linear(D, D, bias=False)

    def forward(self, x):
        b, t, _ = x.shape
        qkv = self.qkv(x)
        if self.negative:  # the same boundaries counted from the end
            q, k, v = qkv[..., :-2 * self.kv], qkv[..., -2 * self.kv:-self.kv], qkv[..., -self.kv:]
        else:
            q, k, v = qkv[..., :D], qkv[..., D:D + self.kv], qkv[..., D + self.kv:]
        q = q.view(b, t, H, HD).transpose(1, 2)
        k, v = (z.view(b, t, -1, HD).transpose(1, 2) for z in (k, v))
        kv_heads = self.kv // HD  # each K/V head repeated for H // kv_heads query heads (Llama's repeat_kv)
        k, v = (z[:, :, None].expand(b, kv_heads, H // kv_heads, t, HD).reshape(b, H, t, HD) for z in (k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, t, D))


def test_fused_qkv_sliced_at_segment_boundaries():
    report = _check(_model(SlicedQKV), _x(B, T, D))
    _split(report, "qkv.weight", "qkv.bias", "o.weight")
    assert report.plan.placements["qkv.weight"].segments == (D, 8, 8)


def test_fused_qkv_sliced_at_negative_boundaries():
    report = _check(_model(SlicedQKV, negative=True), _x(B, T, D))
    _split(report, "qkv.weight", "qkv.bias", "o.weight")
    assert report.plan.placements["qkv.weight"].segments == (D, 8, 8)


# 5. A depthwise conv1d between an in- and an out-projection (a short-conv mixer).

class ShortConv(nn.Module):
    def __init__(self, inner=32, kernel=3):
        super().__init__()
        self.inner = nn.Linear(D, inner, bias=False)
        self.conv = nn.Conv1d(inner, inner, kernel, groups=inner, padding=kernel - 1)
        self.out = nn.Linear(inner, D, bias=False)

    def forward(self, x):
        t = x.shape[1]
        h = self.conv(self.inner(x).transpose(1, 2))[..., :t]
        return self.out(F.silu(h.transpose(1, 2)))


def test_depthwise_conv1d_split_by_channel():
    report = _check(_model(ShortConv), _x(B, T, D))
    _split(report, "inner.weight", "conv.weight", "conv.bias", "out.weight")


# 6. A mixture-of-experts bank stored as 3-D parameters, applied with bmm.

class ExpertBank(nn.Module):
    def __init__(self, experts=4, inner=32):
        super().__init__()
        self.experts = experts
        self.w1 = nn.Parameter(torch.randn(experts, D, inner) / D ** 0.5)
        self.w2 = nn.Parameter(torch.randn(experts, inner, D) / inner ** 0.5)

    def forward(self, x):
        h = torch.bmm(x.reshape(self.experts, -1, D), self.w1)
        return torch.bmm(F.gelu(h), self.w2).reshape(x.shape)


def test_expert_bank_bmm():
    report = _check(_model(ExpertBank), _x(B, 8, D))
    _split(report, "w1", "w2")


def test_expert_bank_bmm_is_found_as_grouped_projections():
    cap = captured(_model(ExpertBank), _x(B, 8, D))
    found = {cap.param_name(p.weight): p for p in find_projections(cap.graph).values()}
    assert set(found) == {"w1", "w2"}
    assert (found["w1"].out_dim, found["w1"].in_dim, found["w1"].out_features) == (2, 1, 32)
    assert (found["w2"].out_dim, found["w2"].in_dim, found["w2"].in_features) == (2, 1, 32)


# 7. Cross-attention: queries from one input, keys and values from another.

class CrossAttention(nn.Module):
    def __init__(self, memory_dim=24):
        super().__init__()
        self.q = nn.Linear(D, D, bias=False)
        self.k = nn.Linear(memory_dim, D, bias=False)
        self.v = nn.Linear(memory_dim, D, bias=True)
        self.o = nn.Linear(D, D, bias=False)

    def forward(self, x, memory):
        b, t, _ = x.shape
        s = memory.shape[1]
        q = self.q(x).view(b, t, H, HD).transpose(1, 2)
        k, v = (p(memory).view(b, s, H, HD).transpose(1, 2) for p in (self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v)
        return self.o(y.transpose(1, 2).reshape(b, t, D))


def test_cross_attention_splits_the_memory_projections():
    report = _check(_model(CrossAttention), _x(B, T, D), _x(B, 5, 24, seed=1))
    _split(report, "q.weight", "k.weight", "v.weight", "v.bias", "o.weight")


# 8. Heads folded into the batch: nn.MultiheadAttention in a small encoder layer.

class MHAEncoder(nn.Module):
    def __init__(self, batch_first: bool):
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.attn = nn.MultiheadAttention(D, H, batch_first=batch_first)
        self.up = nn.Linear(D, 2 * D)
        self.down = nn.Linear(2 * D, D)

    def forward(self, x):
        h = self.norm(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.down(F.gelu(self.up(x)))


@pytest.mark.parametrize("batch_first", [False, True])
def test_multihead_attention_heads_folded_into_the_batch(batch_first):
    shape = (B, T, D) if batch_first else (T, B, D)
    report = _check(_model(MHAEncoder, batch_first), _x(*shape))
    _split(report, "attn.in_proj_weight", "attn.in_proj_bias", "attn.out_proj.weight", "up.weight", "down.weight")


def test_heads_folded_into_the_batch_reshape_algebra():
    b, t = sympy.symbols("B T")  # symbolic, as captured: the folded dim is b blocks of H heads
    folded = map_reshape((t, b, D), (t, b * H, HD), Shard(2, (D,)), tp=2)
    assert folded == Shard(1, (H,), blocks=b)
    assert map_reshape((t, b * H, HD), (t, b, D), folded, tp=2) == Shard(2, (D,))
    assert map_reshape((b * H, t, HD), (b, H, t, HD), Shard(0, (H,), blocks=b), tp=2) == Shard(1, (H,))


# 9. A per-head attention sink [H], expanded and concatenated to the logits before softmax.

class Sinks(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(D, D, bias=False) for _ in range(3))
        self.o = nn.Linear(D, D, bias=False)
        self.sinks = nn.Parameter(torch.randn(H))

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (p(x).view(b, t, H, HD).transpose(1, 2) for p in (self.q, self.k, self.v))
        logits = q @ k.transpose(-1, -2) / HD ** 0.5
        sink = self.sinks.reshape(1, H, 1, 1).expand(b, -1, t, 1)
        probs = torch.softmax(torch.cat([logits, sink], dim=-1), dim=-1)[..., :-1]
        y = probs @ v
        return self.o(y.transpose(1, 2).reshape(b, t, D))


def test_attention_sink_split_with_the_heads():
    report = _check(_model(Sinks), _x(B, T, D))
    _split(report, "q.weight", "k.weight", "v.weight", "o.weight", "sinks")


# 10. Projections with the weight on the left (W @ x^T: features along the second-last dim).

class LeftColumn(nn.Module):
    """A Mamba-like time-step projection: a row projection's whole output ``dt`` is projected back up by
    ``w @ dt^T`` (a column projection from the left) and gates the split features before the row projection."""

    def __init__(self, inner=32, rank=4):
        super().__init__()
        self.up = nn.Linear(D, inner, bias=False)
        self.x_proj = nn.Linear(inner, rank, bias=False)
        self.w = nn.Parameter(torch.randn(inner, rank) / rank ** 0.5)  # [out, in]
        self.down = nn.Linear(inner, D, bias=False)

    def forward(self, x):
        h = F.silu(self.up(x))  # [B, T, I], split
        dt = self.x_proj(h)  # [B, T, R], whole after the all-reduce
        gate = (self.w @ dt.transpose(1, 2)).transpose(1, 2)  # [B, I, T] -> [B, T, I]
        return self.down(h * F.softplus(gate))


class LeftRow(nn.Module):
    """``w @ h^T`` reading the split features: the left projection closes the region (a row split)."""

    def __init__(self, inner=32):
        super().__init__()
        self.up = nn.Linear(D, inner, bias=False)
        self.w = nn.Parameter(torch.randn(D, inner) / inner ** 0.5)

    def forward(self, x):
        return (self.w @ F.silu(self.up(x)).transpose(1, 2)).transpose(1, 2)


def test_weight_on_the_left_column_projection_between_column_and_row():
    report = _check(_model(LeftColumn), _x(B, T, D))
    _split(report, "up.weight", "x_proj.weight", "w", "down.weight")
    placements = report.plan.placements
    assert placements["w"].kind.value == "colwise" and placements["w"].dim == 0


def test_weight_on_the_left_row_projection_closes_the_region():
    report = _check(_model(LeftRow), _x(B, T, D))
    _split(report, "up.weight", "w")
    assert report.plan.placements["w"].kind.value == "rowwise" and report.plan.placements["w"].dim == 1


def test_weight_on_the_left_is_found_as_a_left_projection():
    cap = captured(_model(LeftColumn), _x(B, T, D))
    left = [p for p in find_projections(cap.graph).values() if cap.param_name(p.weight) == "w"]
    assert len(left) == 1 and (left[0].in_axis, left[0].out_axis) == (-2, -2)
    assert (left[0].out_dim, left[0].in_features, left[0].out_features) == (0, 4, 32)


class LoopedScaled(nn.Module):
    """One MLP block run twice (a looped, recurrent-depth stack), its up projection scaled per channel by a
    parameter times a constant (nGPT's ``suv``): the scale is read by the first run too, so it lies upstream of
    the second, yet splitting it with the projection keeps both runs exact."""

    def __init__(self, inner=32):
        super().__init__()
        self.up = nn.Linear(D, inner, bias=False)
        self.scale = nn.Parameter(torch.rand(inner) + 0.5)
        self.down = nn.Linear(inner, D, bias=False)

    def forward(self, x):
        for _ in range(2):
            x = x + self.down(F.silu(self.up(x) * (self.scale * 3.0)))
        return x


def test_a_looped_block_splits_its_scaled_per_channel_parameter():
    report = _check(_model(LoopedScaled), _x(B, T, D))
    _split(report, "up.weight", "scale", "down.weight")


# Known limitation: grouped-query attention through SDPA's enable_gqa is kept whole (safe, exact).

class EnableGQA(nn.Module):
    def __init__(self, kv_heads=2):
        super().__init__()
        self.kv = kv_heads * HD
        self.q = nn.Linear(D, D, bias=False)
        self.k, self.v = (nn.Linear(D, self.kv, bias=False) for _ in range(2))
        self.o = nn.Linear(D, D, bias=False)

    def forward(self, x):
        b, t, _ = x.shape
        q = self.q(x).view(b, t, H, HD).transpose(1, 2)
        k, v = (p(x).view(b, t, -1, HD).transpose(1, 2) for p in (self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o(y.transpose(1, 2).reshape(b, t, D))


def test_sdpa_enable_gqa_is_exact():
    report = _check(_model(EnableGQA), _x(B, T, D))
    _split(report, "q.weight", "k.weight", "v.weight", "o.weight")


class _CachedKeys(nn.Module):
    """Attention whose keys and values are appended to empty 1-D tensors, which ``torch.cat`` skips (a
    transformers cache layer's first update), and put in a ``DynamicCache`` the forward also returns, as a
    block-diffusion encoder does."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(D, D) for _ in range(4))

    def forward(self, x):
        from transformers.cache_utils import DynamicCache

        q, k, v = (z.view(B, -1, H, HD).transpose(1, 2) for z in (self.q(x), self.k(x), self.v(x)))
        k, v = (torch.cat([torch.tensor([]), z], dim=-2) for z in (k, v))
        cache = DynamicCache()
        cache.update(k, v, 0)
        out = F.scaled_dot_product_attention(q, k, v)
        return {"out": self.o(out.transpose(1, 2).reshape(B, -1, D)), "cache": cache}


def test_keys_appended_to_an_empty_tensor_split_by_heads_and_a_returned_cache_dropped():
    pytest.importorskip("transformers")
    report = _check(_model(_CachedKeys), _x(B, T, D))
    regions = [r.to_dict() for r in report.plan.regions]
    assert regions == [{"kind": "attention", "columns": ["q", "k", "v"], "rows": ["o"], "replicated": []}], regions


class _InPlaceActivation(nn.Module):
    """``F.relu(up(x), inplace=True)``: written in place after a column projection (its rank output must be a
    tensor of its own: autograd forbids writing a custom Function's view output in place)."""

    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)

    def forward(self, x):
        return x + self.down(F.relu(self.up(x), inplace=True))


def test_an_in_place_activation_after_a_column_projection():
    report = _check(_model(_InPlaceActivation), _x(B, T, D))
    assert report.plan.placements["up.weight"].is_split and report.plan.placements["down.weight"].is_split
