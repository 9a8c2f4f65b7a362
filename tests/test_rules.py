"""Per-op sharding rules, each on a tiny captured graph: what layout comes out, what each input must be."""

from __future__ import annotations

import torch
from autotp.passes.graph import grad_nodes
from autotp.passes.placement import Shard
from autotp.passes.rules import Context, replicate_all, rule_for
from autotp.passes.steps import COPY

from tests.graphs import captured, node

aten = torch.ops.aten
CTX = Context(tp=2, grad=set())


def _ins(n, layouts: dict) -> dict:
    """Rule inputs for node ``n``: every tensor argument with the layout given by position (default whole)."""
    return {(i,): (a, layouts.get(i)) for i, a in enumerate(n.args) if isinstance(a, torch.fx.Node)}


def test_pointwise_keeps_the_shard_and_slices_a_full_size_operand():
    cap = captured(lambda x, y: x + y, torch.randn(2, 3, 8), torch.randn(2, 3, 8))
    add = node(cap, aten.add.Tensor)
    decision = rule_for(add.target)(add, _ins(add, {0: Shard(2, (8,))}), CTX)
    assert decision.out == Shard(2, (8,))
    assert decision.wants == {(1,): Shard(2, (8,))}  # the whole operand is cut to this rank's part


def test_pointwise_broadcast_operand_stays_whole_through_f_when_it_carries_gradients():
    cap = captured(lambda x, b: x * b, torch.randn(2, 3, 8), torch.randn(1, 1, 1))
    mul = node(cap, aten.mul.Tensor)
    ctx = Context(tp=2, grad=grad_nodes(cap.graph, set()) | {mul.args[1].name})
    decision = rule_for(mul.target)(mul, _ins(mul, {0: Shard(2, (8,))}), ctx)
    assert decision.wants == {(1,): COPY}


def test_pointwise_with_disagreeing_shards_replicates():
    cap = captured(lambda x, y: x + y, torch.randn(2, 8, 8), torch.randn(2, 8, 8))
    add = node(cap, aten.add.Tensor)
    decision = rule_for(add.target)(add, _ins(add, {0: Shard(2, (8,)), 1: Shard(1, (8,))}), CTX)
    assert decision.out is None and decision.wants == {(0,): None, (1,): None}


def test_view_into_heads_moves_the_shard_and_fixes_the_head_count():
    cap = captured(lambda x: x.view(x.shape[0], x.shape[1], 4, 4), torch.randn(2, 3, 16))
    view = node(cap, aten.view.default)
    decision = rule_for(view.target)(view, _ins(view, {0: Shard(2, (16,))}), CTX)
    assert decision.out == Shard(2, (4,))
    assert decision.fixes == {(1, 2): 2}  # 4 heads become 2 per rank
    assert (4, "dim 2 of the reshape to (?, ?, 4, 4)") in decision.checks


def test_whole_input_gives_whole_output_for_shape_rules():
    cap = captured(lambda x: x.transpose(1, 2), torch.randn(2, 3, 16))
    t = node(cap, aten.transpose.int)
    assert rule_for(t.target)(t, _ins(t, {}), CTX).out is None


def test_transpose_follows_the_shard():
    cap = captured(lambda x: x.transpose(1, 2), torch.randn(2, 3, 4, 5))
    t = node(cap, aten.transpose.int)
    assert rule_for(t.target)(t, _ins(t, {0: Shard(2, (4,))}), CTX).out == Shard(1, (4,))


def test_split_at_segment_boundaries_gives_one_shard_per_part():
    cap = captured(lambda x: x.split(8, dim=-1), torch.randn(2, 3, 24))
    split = node(cap, aten.split.Tensor)
    decision = rule_for(split.target)(split, _ins(split, {0: Shard(2, (8, 8, 8))}), CTX)
    assert decision.out == (Shard(2, (8,)),) * 3 and decision.fixes == {(1,): 4}


def test_split_across_a_plain_shard_hints_the_fused_segments():
    cap = captured(lambda x: x.split(8, dim=-1), torch.randn(2, 3, 24))
    split = node(cap, aten.split.Tensor)
    decision = rule_for(split.target)(split, _ins(split, {0: Shard(2, (24,))}), CTX)
    assert decision.out == (None, None, None) and decision.hint == (8, 8, 8)


def test_softmax_over_the_split_dim_needs_it_whole():
    cap = captured(lambda x: x.softmax(dim=-1), torch.randn(2, 3, 8))
    softmax = node(cap, aten.softmax.int)
    decision = rule_for(softmax.target)(softmax, _ins(softmax, {0: Shard(2, (8,))}), CTX)
    assert decision.out is None and decision.wants == {(0,): None}


def test_reduction_over_another_dim_keeps_the_shard():
    cap = captured(lambda x: x.sum(dim=1), torch.randn(2, 3, 8))
    total = node(cap, aten.sum.dim_IntList)
    assert rule_for(total.target)(total, _ins(total, {0: Shard(2, (8,))}), CTX).out == Shard(1, (8,))


def test_attention_split_by_heads_slices_whole_keys_and_values():
    q = torch.randn(2, 4, 3, 8)
    cap = captured(lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(q, k, v), q, q, q)
    sdpa = node(cap, aten.scaled_dot_product_attention.default)
    decision = rule_for(sdpa.target)(sdpa, _ins(sdpa, {0: Shard(1, (4,))}), CTX)
    assert decision.out == Shard(1, (4,))
    assert decision.wants == {(1,): Shard(1, (4,)), (2,): Shard(1, (4,))}


def test_unknown_ops_get_the_safe_rule():
    cap = captured(lambda x: torch.linalg.qr(x).Q, torch.randn(4, 4))
    qr = next(n for n in cap.graph.nodes if n.op == "call_function" and "qr" in str(n.target))
    assert rule_for(qr.target) is replicate_all
