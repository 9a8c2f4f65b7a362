"""Sharding propagation on tiny graphs: regions close at the row projection, conversions and fixes are recorded."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from autotp.capture import capture
from autotp.passes.placement import Shard
from autotp.passes.propagate import propagate
from autotp.passes.steps import COPY, Operator, gather
from torch import nn

from tests.graphs import MLP, Heads, captured
from tests.models import build, tokens


def _propagate(cap, column_weights: dict[str, Shard], tp=2, auto_rows=False):
    analysis = cap.analysis
    layouts = {cap.attr_target(n): lay for n, lay in column_weights.items()}
    return analysis, propagate(cap.graph, analysis.projections, analysis.embeddings, layouts, tp, analysis.trainable,
                               auto_rows=auto_rows)


def test_mlp_column_split_closes_at_the_row_projection():
    cap = captured(MLP(), torch.randn(2, 3, 8))
    analysis, prop = _propagate(cap, {"up.weight": Shard(0, (16,))}, auto_rows=True)
    (row,) = prop.rows
    assert analysis.module(row) == "down"
    assert prop.reduced == {row: Operator.G}
    (conv,) = prop.conversions.values()
    assert conv.steps == (COPY,)  # f before the column-split projection
    assert not prop.violations


def test_split_value_reaching_the_output_is_gathered():
    cap = captured(MLP(), torch.randn(2, 3, 8))
    analysis, prop = _propagate(cap, {"up.weight": Shard(0, (16,))}, auto_rows=False)
    steps = [s for c in prop.conversions.values() for s in c.steps]
    assert gather(Shard(2, (16,))) in steps and prop.steps_of(Operator.GATHER)
    assert prop.reduced == {}


def test_fused_qkv_and_head_views_record_fixes_and_divisibility():
    cap = captured(Heads(dim=16, heads=4), torch.randn(2, 3, 16))
    analysis, prop = _propagate(cap, {"qkv.weight": Shard(0, (16, 16, 16))}, auto_rows=True)
    assert [analysis.module(r) for r in prop.rows] == ["out"]
    fixes = {(analysis.nodes[name].target.__name__, path, value) for name, path, value in prop.fixes}
    assert ("split.Tensor", (1,), 8) in fixes  # split(16) becomes split(8): each rank's share of Q, K and V
    assert ("view.default", (1, 2), 2) in fixes  # view(B, T, 4, 4) becomes view(B, T, 2, 4)
    assert ("reshape.default", (1, 2), 8) in fixes  # the merge back: 16 features become 8
    assert not prop.steps_of(Operator.GATHER)


def test_sizes_that_tp_does_not_divide_are_violations():
    cap = captured(Heads(dim=12, heads=3), torch.randn(2, 3, 12))
    _, prop = _propagate(cap, {"qkv.weight": Shard(0, (12, 12, 12))}, auto_rows=True)
    assert any(v.size == 3 for v in prop.violations)


def _outcome(prop, nodes) -> dict:
    """What a propagation tells a search, with the parameter reads (which a windowed walk leaves out) dropped."""
    def read(name):
        return nodes[name].op != "get_attr"

    def split(lay):
        return isinstance(lay, Shard) or isinstance(lay, tuple) and any(isinstance(x, Shard) for x in lay)

    return {"layouts": {n: lay for n, lay in prop.layouts.items() if split(lay) and read(n)},
            "conversions": {k: c.consumers for k, c in prop.conversions.items()},
            "reduced": {n: op for n, op in prop.reduced.items() if read(n)}, "rows": prop.rows,
            "fixes": prop.fixes, "violations": prop.violations, "hints": prop.hints, "checked": prop.checked,
            "refusals": prop.refusals, "origins": {n: o for n, o in prop.origins.items() if read(n)}}


@pytest.mark.parametrize("name", ["hf_llama", "hf_gpt2", "raw_gpt"])
def test_a_windowed_walk_finds_what_the_whole_walk_finds(name):
    """Every projection split by rows, then by columns, alone: the walk from its weight's reader until no split
    value is live (what the region search runs, linear in depth) records what the walk of the whole graph does."""
    model = build(name, layers=3)
    cap = capture(model, tokens(2, 8, seed=0))
    analysis = cap.analysis
    for proj in analysis.projections.values():
        for layout in (Shard(proj.in_dim, (proj.in_features,)), Shard(proj.out_dim, (proj.out_features,))):
            runs = [propagate(cap.graph, analysis.projections, analysis.embeddings, {proj.weight: layout}, 2,
                              analysis.trainable, auto_rows=True, windowed=windowed) for windowed in (True, False)]
            assert _outcome(runs[0], analysis.nodes) == _outcome(runs[1], analysis.nodes), (proj.node, layout)


def test_a_windowed_walk_refuses_what_splits_values_before_it():
    cap = captured(MLP(), torch.randn(2, 3, 8))
    analysis = cap.analysis
    with pytest.raises(ValueError, match="windowed"):
        propagate(cap.graph, analysis.projections, analysis.embeddings, {}, 2, analysis.trainable, windowed=True,
                  inputs={"x": Shard(2, (8,))})


def test_a_windowed_walk_of_a_mixture_of_experts_finds_what_the_whole_walk_finds():
    """The same for DeepSeek-V3's mixture of experts, whose down projections split by columns reach the LM head:
    the windowed walk visits only the readers of split values, and shares the rules' decisions between walks."""
    from tests.moe_workers import deepseek

    cap = capture(deepseek(), tokens(2, 8, seed=0))
    analysis = cap.analysis
    decisions: dict = {}
    for proj in [p for p in analysis.projections.values() if ".mlp." in analysis.layer(p.node)]:
        for layout in (Shard(proj.in_dim, (proj.in_features,)), Shard(proj.out_dim, (proj.out_features,))):
            runs = [propagate(cap.graph, analysis.projections, analysis.embeddings, {proj.weight: layout}, 2,
                              analysis.trainable, auto_rows=True, windowed=windowed, decisions=shared)
                    for windowed, shared in ((True, decisions), (False, None))]
            assert _outcome(runs[0], analysis.nodes) == _outcome(runs[1], analysis.nodes), (proj.node, layout)
    assert decisions  # the walks did share them


def test_ancestors_found_as_far_back_as_asked_are_all_of_them():
    """``origins.Ancestors`` walks back only as far as each question needs, and answers as the whole walk back."""
    from autotp.passes.graph_index import GraphIndex
    from autotp.passes.origins import Ancestors

    cap = capture(build("hf_llama", layers=2), tokens(2, 8, seed=0))
    order = list(cap.graph.nodes)
    index = GraphIndex.of(cap.graph)
    for start in (order[len(order) // 3], order[len(order) // 2], order[-2]):
        everything, stack = set(), [start]
        while stack:
            node = stack.pop()
            if node.name not in everything:
                everything.add(node.name)
                stack.extend(node.all_input_nodes)
        lazy = Ancestors([start], index)
        for node in reversed(order):  # latest first, then earlier ones (the order a trace asks in)
            assert (node.name in lazy) == (node.name in everything), (start.name, node.name)
        lazy = Ancestors([start], index)
        for node in order:  # earliest first: one walk back answers the rest
            assert (node.name in lazy) == (node.name in everything), (start.name, node.name)


class _RotaryPartOfSizeZero(nn.Module):
    """Low-rank attention whose rotary key part has size 0 (a layer without rotary positions, as GLM's NoPE
    layers): the shared key part read through ``f`` is a value of no elements, and hoisting that ``f`` compares
    sizes 0/0 (NaN)."""

    def __init__(self, width: int = 64, heads: int = 4, rank: int = 16, rope: int = 0):
        super().__init__()
        self.heads, self.dim, self.rank, self.rope = heads, width // heads, rank, rope
        self.q = nn.Linear(width, heads * (self.dim + rope), bias=False)
        self.kv_a = nn.Linear(width, rank + rope, bias=False)
        self.kv_b = nn.Linear(rank, heads * 2 * self.dim, bias=False)
        self.o = nn.Linear(heads * self.dim, width, bias=False)

    def forward(self, x):
        b, t, _ = x.shape
        q = self.q(x).view(b, t, self.heads, self.dim + self.rope).transpose(1, 2)
        latent, k_rope = self.kv_a(x).split([self.rank, self.rope], dim=-1)
        k_rope = k_rope.view(b, 1, t, self.rope).expand(b, self.heads, t, self.rope)
        k, v = self.kv_b(latent).view(b, t, self.heads, 2 * self.dim).transpose(1, 2).split([self.dim, self.dim], -1)
        y = F.scaled_dot_product_attention(q, torch.cat([k, k_rope], dim=-1), v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, t, -1))


def test_a_value_of_no_elements_read_through_f_plans_and_checks_exactly():
    import autotp

    torch.manual_seed(0)
    report = autotp.check(_RotaryPartOfSizeZero(), 2, torch.randn(2, 8, 64))
    assert report.exact, str(report)
    assert report.plan.placements["kv_b.weight"].is_split and report.plan.placements["o.weight"].is_split


class _CatWithEmptyPart(torch.nn.Module):
    """A split value concatenated after an empty 1-D tensor, which torch.cat skips (PI0 builds its prefix so)."""

    def __init__(self):
        super().__init__()
        self.up, self.down = torch.nn.Linear(16, 32), torch.nn.Linear(32, 16)

    def forward(self, x):
        return self.down(torch.cat([x.new_zeros(0), torch.relu(self.up(x))], dim=-1))


def test_a_cat_with_a_part_of_another_rank_is_planned_and_exact():
    import autotp

    torch.manual_seed(0)
    report = autotp.check(_CatWithEmptyPart(), 2, torch.randn(2, 3, 16))
    assert report.exact, str(report)
