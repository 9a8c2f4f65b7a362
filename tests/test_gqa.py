"""Grouped-query attention with tp above its KV heads: each rank keeps the KV head its query heads use (a chunk
held by tp / KV-heads ranks), not the whole K/V, and their gradients are summed over the holders; exact."""

from __future__ import annotations

import pytest
import torch
from autotp.passes.placement import Placement, part_of
from autotp.passes.steps import Operator

import autotp
from autotp.planning.plan import Plan
from tests import capture_cache, checkpoint_workers, gqa_workers, models
from tests.distributed import run_on_ranks


def _llama(heads: int, kv: int, **extra):
    import transformers

    config = transformers.LlamaConfig(vocab_size=models.VOCAB, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=heads, num_key_value_heads=kv,
                                      head_dim=64 // heads, **extra)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def _qwen3():
    import transformers

    config = transformers.Qwen3Config(vocab_size=models.VOCAB, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    torch.manual_seed(0)
    return transformers.Qwen3ForCausalLM(config)


def test_a_shared_chunk_is_the_kv_head_of_the_ranks_query_heads():
    """K of 2 heads x 16 at tp=4: ranks 0 and 1 hold head 0, ranks 2 and 3 head 1."""
    placement = Placement("colwise", 0, (), replicas=2)
    assert [part_of(placement, (32, 64), r, 4).runs for r in range(4)] == [((0, 16),), ((0, 16),), ((16, 16),),
                                                                          ((16, 16),)]
    assert Plan.from_json(Plan(tp=4, placements={"k": placement}).to_json()).placements["k"] == placement
    with pytest.raises(autotp.PlanError, match="2 chunks do not divide"):
        from autotp.planning.plan import check_plan_fits
        check_plan_fits(Plan(tp=4, placements={"k": placement}), {"k": (31, 64)})


@pytest.mark.parametrize("build, tp, holders", [(lambda: _llama(4, 2), 4, 2), (lambda: _llama(8, 2), 8, 4),
                                                (_qwen3, 4, 2)])
def test_kv_heads_shared_check_exact(build, tp, holders):
    """Llama at 2 and 4 ranks per KV head; Qwen3, whose per-head K norm reads the shared chunks."""
    ids = models.tokens(2, 8, 0)
    report = autotp.check(build(), tp, ids, vocab="split")
    assert report.exact, str(report)
    shared = {n: p for n, p in report.plan.placements.items() if p.replicas != 1}
    assert {n.rsplit(".", 2)[-2] for n in shared} == {"k_proj", "v_proj"}
    assert {p.replicas for p in shared.values()} == {holders}
    assert sum(c.operator is Operator.SHARED_GRAD for c in report.plan.collectives) == len(shared)
    assert not any("kept replicated" in n for n in report.plan.notes)


def test_kv_heads_shared_with_sequence_parallelism_check_exact():
    report = autotp.check(_llama(4, 2), 4, models.tokens(2, 8, 0), vocab="split", sequence_parallel=True)
    assert report.exact, str(report)
    assert any(p.replicas == 2 for p in report.plan.placements.values())


def test_exports_leave_shared_kv_heads_out():
    from autotp.tools.exports import Target, export_styles

    plan = autotp.plan(_llama(4, 2), 4, models.tokens(2, 8, 0))
    skipped = export_styles(plan, Target.HF).skipped
    assert any("k_proj" in m and "shared by several ranks" in why for m, why in skipped.items()), skipped


def test_shared_kv_heads_train_clip_and_checkpoint_on_four_ranks(tmp_path):
    # Captured here once: the four ranks (two to a core) find it, rather than each capturing it again.
    capture_cache.warm(checkpoint_workers.llama(meta=True, layers=1), (models.tokens(2, 8, seed=1),))
    results = run_on_ranks(gqa_workers.shared_kv_heads, 4, str(tmp_path))
    for r in results:
        assert r["k_proj"] == [16, 64]  # one KV head of 16, not both
        # Parameters per rank: a quarter of each split one, half of each K/V (not all of it, as before: the
        # difference is whole_kv_params).
        assert r["local_params"] == r["planned_params"] and r["whole_kv_params"] > 0, r


def _repeated(kv: torch.Tensor, group: int) -> torch.Tensor:
    """K or V ``[batch, kv heads, length, dim]`` with each head repeated for its ``group`` query heads."""
    b, heads, t, dim = kv.shape
    return kv[:, :, None].expand(b, heads, group, t, dim).reshape(b, heads * group, t, dim)


class _GroupedQuery(torch.nn.Module):
    """Q/K/V/O projections of attention with ``kv`` KV heads for ``heads`` query heads (the forwards below use them)."""

    def __init__(self, width: int = 64, heads: int = 4, kv: int = 2):
        super().__init__()
        self.heads, self.kv, self.dim = heads, kv, width // heads
        self.q = torch.nn.Linear(width, width, bias=False)
        self.k = torch.nn.Linear(width, kv * self.dim, bias=False)
        self.v = torch.nn.Linear(width, kv * self.dim, bias=False)
        self.o = torch.nn.Linear(width, width, bias=False)


class _HeadNormAttention(_GroupedQuery):
    """Attention with 2 KV heads whose keys are normalised per head with a weight per head ([heads, head_dim],
    as Chameleon's k_norm): at tp=4 each KV head, and its row of the norm's weight, is held by two ranks."""

    def __init__(self, width: int = 64, heads: int = 4, kv: int = 2):
        super().__init__(width, heads, kv)
        self.norm_weight = torch.nn.Parameter(1 + 0.1 * torch.randn(kv, self.dim))
        self.norm_bias = torch.nn.Parameter(0.1 * torch.randn(kv, self.dim))

    def forward(self, x):
        b, t, _ = x.shape
        q = self.q(x).view(b, t, self.heads, self.dim).transpose(1, 2)
        k = self.k(x).reshape(-1, self.kv, self.dim)
        k = torch.nn.functional.layer_norm(k, (self.dim,)) * self.norm_weight + self.norm_bias
        k = k.reshape(b, t, self.kv, self.dim).transpose(1, 2)
        v = self.v(x).view(b, t, self.kv, self.dim).transpose(1, 2)
        group = self.heads // self.kv  # repeat_kv: each KV head expanded over its query heads
        k, v = _repeated(k, group), _repeated(v, group)
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, t, -1))


def test_a_per_head_norm_weight_of_shared_kv_heads_is_shared_like_them():
    """The norm's weight rows follow the KV heads: two holders each, not split four ways (zero rows a rank)."""
    torch.manual_seed(0)
    report = autotp.check(_HeadNormAttention(), 4, torch.randn(2, 8, 64))
    assert report.exact, str(report)
    assert report.plan.placements["norm_weight"] == Placement("colwise", 0, (), replicas=2)
    assert report.plan.placements["norm_bias"] == Placement("colwise", 0, (), replicas=2)


class _StackedKVAttention(_GroupedQuery):
    """Attention with 2 KV heads whose keys and values are stacked into one tensor and taken apart again (as BLT's
    cross-attention does): at tp=4 the stack meets chunks two ranks hold, which tp does not divide."""

    def forward(self, x):
        b, t, _ = x.shape
        q = self.q(x).view(b, t, self.heads, self.dim).transpose(1, 2)
        k = self.k(x).view(b, t, self.kv, self.dim).transpose(1, 2)
        v = self.v(x).view(b, t, self.kv, self.dim).transpose(1, 2)
        k, v = torch.stack((k, v)).unbind(0)
        group = self.heads // self.kv
        y = torch.nn.functional.scaled_dot_product_attention(q, _repeated(k, group), _repeated(v, group))
        return self.o(y.transpose(1, 2).reshape(b, t, -1))


def test_shared_kv_heads_meeting_an_op_that_cannot_narrow_them_are_gathered_exactly():
    """A stack of K and V heads two ranks hold each (tp=4, 2 KV heads): the stack's rule knows no such chunks and
    they cannot be narrowed four ways, so it reads them whole (this crashed the planner once)."""
    torch.manual_seed(0)
    report = autotp.check(_StackedKVAttention(), 4, torch.randn(2, 8, 64))
    assert report.exact, str(report)


class _ValueBiasAttention(torch.nn.Module):
    """Attention with 2 KV heads whose values' features feed a small projection giving each KV head a bias per key
    (Doge's dynamic mask): at tp=4 that projection reads chunks two ranks hold, each narrowing to its plain part."""

    def __init__(self, width: int = 64, heads: int = 4, kv: int = 2):
        super().__init__()
        self.heads, self.kv, self.dim = heads, kv, width // heads
        self.q = torch.nn.Linear(width, width, bias=False)
        self.k = torch.nn.Linear(width, kv * self.dim, bias=False)
        self.v = torch.nn.Linear(width, kv * self.dim, bias=False)
        self.dt = torch.nn.Linear(kv * self.dim, kv)
        self.o = torch.nn.Linear(width, width, bias=False)

    def forward(self, x):
        b, t, _ = x.shape
        group = self.heads // self.kv
        q = self.q(x).view(b, t, self.heads, self.dim).transpose(1, 2)
        k = self.k(x).view(b, t, self.kv, self.dim).transpose(1, 2)
        v = self.v(x).view(b, t, self.kv, self.dim).transpose(1, 2)
        bias = self.dt(v.transpose(1, 2).reshape(b, t, -1)).transpose(1, 2)  # [b, kv, keys]
        bias = bias[:, :, None, None, :].expand(b, self.kv, group, t, t).reshape(b, self.heads, t, t)
        k, v = _repeated(k, group), _repeated(v, group)
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        return self.o(y.transpose(1, 2).reshape(b, t, -1))


@pytest.mark.parametrize("tp, holders", [(2, 1), (4, 2)])
def test_a_projection_of_shared_value_heads_is_split_by_rows(tp, holders):
    """The bias projection reads V's features: split by rows at both tp, at tp=4 from the chunks two ranks hold."""
    torch.manual_seed(0)
    report = autotp.check(_ValueBiasAttention(), tp, torch.randn(2, 8, 64))
    assert report.exact, str(report)
    assert report.plan.placements["dt.weight"] == Placement("rowwise", 1)
    assert report.plan.placements["v.weight"] == Placement("colwise", 0, (), replicas=holders)


class _FusedQKVAttention(torch.nn.Module):
    """Attention with 4 query heads and 2 KV heads from one fused projection (Phi-3's ``qkv_proj``), sliced."""

    def __init__(self, width: int = 64, heads: int = 4, kv: int = 2):
        super().__init__()
        self.heads, self.kv, self.dim = heads, kv, width // heads
        self.qkv = torch.nn.Linear(width, width + 2 * kv * self.dim, bias=False)
        self.o = torch.nn.Linear(width, width, bias=False)

    def forward(self, x):
        b, t, width = x.shape
        group, kv_width = self.heads // self.kv, self.kv * self.dim
        qkv = self.qkv(x)
        q = qkv[..., :width].view(b, t, self.heads, self.dim).transpose(1, 2)
        k = qkv[..., width:width + kv_width].view(b, t, self.kv, self.dim).transpose(1, 2)
        v = qkv[..., width + kv_width:].view(b, t, self.kv, self.dim).transpose(1, 2)
        k, v = _repeated(k, group), _repeated(v, group)
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, t, -1))


@pytest.mark.parametrize("tp, holders", [(2, 1), (4, 2)])
def test_a_fused_qkv_past_its_kv_heads_is_held_by_several_ranks_per_chunk(tp, holders):
    """At tp=4 the fused projection's K/V segments have 2 heads: every segment is cut in 2 chunks held by 2 ranks
    each, and each rank narrows its queries to its own head where they meet the keys; the output projection is
    split 4 ways."""
    torch.manual_seed(0)
    report = autotp.check(_FusedQKVAttention(), tp, torch.randn(2, 8, 64))
    assert report.exact, str(report)
    assert report.plan.placements["qkv.weight"] == Placement("colwise", 0, (64, 32, 32), replicas=holders)
    assert report.plan.placements["o.weight"] == Placement("rowwise", 1)
