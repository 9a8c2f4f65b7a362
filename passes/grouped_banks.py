"""The banks of experts that grouped matmuls read, found in a graph (read-only): which ``get_attr`` each grouped
matmul reads its experts' matrices from, how many experts it holds, and the chains of grouped matmuls (gate-up,
then down) over one token order that expert parallelism splits (``rewrite.expert_dispatch``)."""

from __future__ import annotations

import torch
from torch import fx

from autotp.passes.placement import PlacementKind
from autotp.passes.projections import grouped_ops

aten = torch.ops.aten

_CHAIN_DEPTH = 12
"""How many ops may lie between two grouped matmuls of one chain (an activation, a product of halves, a cast)."""


def bank_of(weight: fx.Node) -> fx.Node | None:
    """The ``get_attr`` a grouped matmul's weight is read from (through a transpose or a cast)."""
    while isinstance(weight, fx.Node) and weight.op == "call_function" and weight.args:
        weight = weight.args[0]
    return weight if isinstance(weight, fx.Node) and weight.op == "get_attr" else None


def grouped_matmuls(graph: fx.Graph) -> list[fx.Node]:
    """The grouped matmuls of ``graph`` (rows sorted by expert, per-expert offsets), in graph order."""
    ops = set(grouped_ops()) - {aten.bmm.default}
    return [n for n in graph.nodes if n.op == "call_function" and n.target in ops]


def banks_of(graph: fx.Graph) -> dict[str, int]:
    """The ``get_attr`` target of every bank a grouped matmul reads, with its experts (its first dim)."""
    out = {}
    for mm in grouped_matmuls(graph):
        bank = bank_of(mm.args[1])
        if bank is not None:
            out[bank.target] = int(bank.meta["val"].shape[0])
    return out


def _reaches(start: fx.Node, targets: set[fx.Node]) -> bool:
    frontier, seen = [start], {start}
    for _ in range(_CHAIN_DEPTH):
        frontier = [u for n in frontier for u in n.users if u not in seen and not seen.add(u)]
        if targets & set(frontier):
            return True
    return False


def offsets_of(mm: fx.Node) -> fx.Node:
    """The per-expert row offsets a grouped matmul takes."""
    return mm.args[2] if len(mm.args) > 2 else mm.kwargs["offs"]


def expert_matmuls(graph: fx.Graph, targets) -> list[tuple[fx.Node, bool, bool]]:
    """Each grouped matmul over a bank among ``targets`` (``get_attr`` targets split by their experts), with whether
    it starts its chain (no other such matmul reaches its rows: ``f`` there) and whether it ends it (its output
    reaches no other: ``g`` there)."""
    mms = [mm for mm in grouped_matmuls(graph) if (bank := bank_of(mm.args[1])) is not None and bank.target in targets]
    chosen = set(mms)
    return [(mm, not any(_reaches(other, {mm}) for other in chosen - {mm}), not _reaches(mm, chosen - {mm}))
            for mm in mms]


def expert_placements(captured, plan) -> dict[str, object]:
    """The placements of ``plan`` that split a bank by its experts, keyed by the ``get_attr`` target it is read
    through in ``captured``'s graph."""
    return {captured.attr_target(captured.aliases.get(n, n)): p for n, p in plan.placements.items()
            if p.kind is PlacementKind.EXPERT}
