"""The stage splitter on a small GPT at tp=1: stages chained in one process compute the whole model."""

from __future__ import annotations

import torch
from torch.testing import assert_close

from autotp.torch_private import is_guard_call
from autotp.options import Options
from autotp.planning import make_plan
from autotp.rewrite import build_graph, materialise, split_stages
from autotp.rewrite.stage_graphs import HIDDEN
from tests import models
from tests.graphs import captured


def _stages(pp: int):
    torch.manual_seed(0)
    model, ids = models.build("gpt", layers=4), models.tokens(2, 16, 0)
    cap = captured(model, ids)
    plan = make_plan(cap, Options(pp=pp))
    analysis = cap.analysis
    graphs = split_stages(build_graph(cap, plan, 0, None), analysis, plan, list(range(pp)))
    for g in graphs:
        materialise(g, cap, plan, 0)
    return model, ids, plan, graphs


def _chain(graphs, ids):
    out = graphs[0](ids)
    for g in graphs[1:]:
        out = g(out[0], *out[1:])
    return out


def test_chained_stages_equal_the_model():
    model, ids, plan, graphs = _stages(pp=3)
    assert len(graphs) == 3
    (logits,) = _chain(graphs, ids)
    assert_close(logits, model(ids), rtol=1e-5, atol=1e-6)


def test_inner_stages_take_the_hidden_state_and_pass_the_inputs_on():
    _, ids, _, graphs = _stages(pp=2)
    first, second = graphs
    hidden, *inputs = first(ids)
    assert hidden.shape == (2, 16, 64) and len(inputs) == 1 and torch.equal(inputs[0], ids)
    placeholders = [n.target for n in second.graph.nodes if n.op == "placeholder"]
    assert placeholders[0] == HIDDEN and len(placeholders) == 2


def test_stages_hold_only_their_own_blocks():
    _, _, plan, graphs = _stages(pp=2)
    first = {k for k, _ in graphs[0].named_parameters()}
    second = {k for k, _ in graphs[1].named_parameters()}
    assert not any(".h.3." in k for k in first) and not any(".h.0." in k for k in second)
    assert not any(is_guard_call(n) for g in graphs for n in g.graph.nodes)


class _NoGradMiddle(torch.nn.Module):
    """Three blocks, the middle one run without gradients: the graph narrows to one value inside it too."""

    def __init__(self):
        super().__init__()
        self.first, self.middle, self.last = (torch.nn.Linear(8, 8) for _ in range(3))

    def forward(self, x):
        h = self.first(x).relu()
        with torch.no_grad():
            h = self.middle(h).relu() * 2
        return self.last(h + x)


def test_no_cut_falls_where_gradients_are_off():
    from autotp.passes.cuts import find_cuts

    cap = captured(_NoGradMiddle(), torch.randn(2, 3, 8))
    nodes = list(cap.graph.nodes)
    switches = [i for i, n in enumerate(nodes) if n.target is torch._C._set_grad_enabled]
    assert len(switches) == 2, cap.graph  # the middle block was inlined between the two
    cuts = find_cuts(cap.graph, {n.target for n in nodes if n.op == "get_attr"})
    inside = {n.name for n in nodes[switches[0]:switches[1]]}
    assert cuts and not [c for c in cuts if switches[0] <= c.position < switches[1] or c.value in inside], cuts
