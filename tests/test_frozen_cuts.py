"""Pipeline cuts of models with frozen parameters: a value computed from frozen weights and the inputs (a frozen
embedding's output, a peft model's residual stream) crosses a stage boundary like the hidden state, so no cut
leaves one behind, and a stage that would have to recompute one is refused instead."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from autotp.errors import PlanError
from autotp.options import Options
from autotp.passes.cuts import find_cuts
from autotp.passes.graph import frozen_activations, frozen_attrs, grad_nodes
from autotp.planning import make_plan
from autotp.rewrite import build_graph, materialise, split_stages
from tests import models
from tests.graphs import captured


class _FrozenEmbedding(nn.Module):
    """A frozen embedding under two residual blocks that train."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(16, 8).requires_grad_(False)
        self.first, self.second = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, ids):
        h = self.embed(ids)
        h = h + self.first(h).relu()
        return h + self.second(h).relu()


def _left_behind(graph, cuts, trainable) -> list[str]:
    """Frozen activations made before a cut and read after it."""
    position = {n.name: i for i, n in enumerate(graph.nodes)}
    frozen = frozen_attrs(graph.owning_module) - trainable
    held = frozen_activations(graph, frozen, grad_nodes(graph, trainable))
    nodes = {n.name: n for n in graph.nodes}
    return [f"{v} across {c.value}" for c in cuts for v in held
            if position[v] <= c.position < max(position[u.name] for u in nodes[v].users)]


def test_no_cut_leaves_a_frozen_activation_behind():
    cap = captured(_FrozenEmbedding(), torch.randint(0, 16, (2, 5)))
    trainable = {n for n, p in cap.module.named_parameters() if p.requires_grad}
    cuts = find_cuts(cap.graph, trainable)
    assert cuts and not _left_behind(cap.graph, cuts, trainable), cuts  # a cut between the blocks, after the add
    ignored = find_cuts(cap.graph, trainable, frozen=set())  # as if the embedding's output were an input's
    assert _left_behind(cap.graph, ignored, trainable), ignored  # the cut before the first residual add


def _adapted_stages():
    """The 2-layer peft Llama at pp=2 under ``interleaved1f1b`` (4 stages), its stages split in one process."""
    pytest.importorskip("peft")
    from tests.lora_workers import adapted

    model, ids = adapted().train(), models.tokens(2, 8, 1)
    cap = captured(model, ids)
    plan = make_plan(cap, Options(pp=2, schedule="interleaved1f1b"))
    graphs = split_stages(build_graph(cap, plan, 0, None), cap.analysis, plan, list(range(len(plan.stages))))
    for g in graphs:
        materialise(g, cap, plan, 0)
    return model, ids, plan, graphs


def test_stages_cut_inside_layers_of_a_peft_model_compute_its_gradients():
    """The planner's 4 stages of the 2-layer peft Llama (each layer cut before its MLP), chained in one process:
    the loss and every adapter's gradient are the model's, and only the first stage looks the embedding up."""
    model, ids, plan, graphs = _adapted_stages()
    assert any(s.modules[0].endswith("layers.0.mlp") for s in plan.stages), plan.stages  # a cut inside a layer
    assert [g for g in graphs[1:] if any(n.target is torch.ops.aten.embedding.default for n in g.graph.nodes)] == []
    model(ids).logits.pow(2).mean().backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad(set_to_none=True)  # the stages may hold the model's own tensors (tp=1)
    out = graphs[0](ids)
    for g in graphs[1:]:
        out = g(out[0], *out[1:])
    out[0].pow(2).mean().backward()
    got = {n.removeprefix("model."): p.grad for g in graphs for n, p in g.named_parameters() if p.requires_grad}
    assert got.keys() == want.keys()
    assert max((got[n] - want[n]).abs().max().item() for n in want) < 1e-6


def test_a_stage_that_would_recompute_frozen_work_is_refused(monkeypatch):
    """Boundaries from cuts that ignore the frozen activations (the stage after the first attention would look the
    embedding up again and rebuild the residual stream): refused at set-up, naming the value."""
    from autotp.rewrite import stage_graphs

    monkeypatch.setattr(stage_graphs, "find_cuts", lambda graph, trainable, grad: find_cuts(graph, trainable, grad,
                                                                                            frozen=set()))
    with pytest.raises(PlanError, match="computed from frozen parameters and the inputs"):
        _adapted_stages()
