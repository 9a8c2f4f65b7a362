"""Which values the gradient flows through (``passes.graph.grad_nodes``): tensors computed from a trainable
parameter, never a number read off one (a size), whose shape the passes would ask for."""

from __future__ import annotations

import torch
from torch import nn

from autotp.passes.graph import grad_nodes, meta_val, trainable_attrs
from tests.graphs import captured

aten = torch.ops.aten


class _Viewed(nn.Module):
    """An embedding's rows projected and viewed as heads of 4."""

    def __init__(self):
        super().__init__()
        self.emb, self.proj = nn.Embedding(16, 8), nn.Linear(8, 16)

    def forward(self, ids):
        return self.proj(self.emb(ids)).reshape(ids.size(0), ids.size(1), -1, 4).sum(-1)


def _sizes_read_off(graph: torch.fx.Graph, target: torch.fx.Node, reshape: torch.fx.Node) -> list[torch.fx.Node]:
    """``reshape`` made to read its batch and sequence sizes off ``target`` (``y.size(0)``), as Qwen4-exp's indexer
    reads them off a repeated embedding; export reads them off the inputs where it can, so the graph is edited."""
    with graph.inserting_before(reshape):
        sizes = [graph.call_function(aten.sym_size.int, (target, d)) for d in (0, 1)]
    for d, size in enumerate(sizes):
        size.meta["val"] = meta_val(target).shape[d]
    reshape.args = (reshape.args[0], [*sizes, *reshape.args[1][2:]])
    return sizes


def test_sizes_of_a_tensor_the_gradient_reaches_carry_no_gradient():
    cap = captured(_Viewed(), torch.randint(0, 16, (2, 5)))
    embedding = next(n for n in cap.graph.nodes if n.target is aten.embedding.default)
    reshape = next(n for n in cap.graph.nodes if n.target is aten.reshape.default)
    sizes = _sizes_read_off(cap.graph, embedding, reshape)
    grad = grad_nodes(cap.graph, trainable_attrs(cap.module))
    assert {embedding.name, reshape.name} <= grad
    assert not {n.name for n in sizes} & grad
    assert all(not isinstance(meta_val(n), (int, torch.SymInt)) for n in cap.graph.nodes if n.name in grad)
