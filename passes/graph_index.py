"""Lookups over one graph that every propagation of it shares: node order and positions, each node's tensor
inputs and rank, and who reads each parameter; built once per graph (``GraphIndex.of``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from autotp.passes.graph import ArgPath, is_tensor, rank, tensor_args
from torch import fx


@dataclass
class GraphIndex:
    """Lookups over a graph that many propagations share (build once per graph)."""

    order: list[fx.Node]
    nodes: dict[str, fx.Node]
    readers: dict[str, list[int]]
    """``get_attr`` target -> positions of the nodes reading it."""
    positions: dict[fx.Node, int]
    """Node -> its position in ``order``."""
    tensor_args: dict[fx.Node, list[tuple[ArgPath, fx.Node, bool]]] = field(default_factory=dict)
    """Node -> ``graph.tensor_args`` with whether each carries a tensor (found once, read by every walk)."""
    ranks: dict[fx.Node, int] = field(default_factory=dict)
    """Node -> its tensor's rank (found once: every walk reads a projection's)."""

    def rank(self, node: fx.Node) -> int:
        """``graph.rank(node)``, found once."""
        found = self.ranks.get(node)
        if found is None:
            found = self.ranks[node] = rank(node)
        return found

    def args(self, node: fx.Node) -> list[tuple[ArgPath, fx.Node, bool]]:
        """``node``'s (path, input node, whether it holds a tensor)."""
        found = self.tensor_args.get(node)
        if found is None:
            found = self.tensor_args[node] = [(p, n, is_tensor(n)) for p, n in tensor_args(node)]
        return found

    @classmethod
    def of(cls, graph: fx.Graph) -> GraphIndex:
        """Index ``graph``."""
        order = list(graph.nodes)
        readers: dict[str, list[int]] = {}
        for i, node in enumerate(order):
            for a in node.all_input_nodes:
                if a.op == "get_attr":
                    readers.setdefault(a.target, []).append(i)
        return cls(order, {n.name: n for n in order}, readers, {n: i for i, n in enumerate(order)})
