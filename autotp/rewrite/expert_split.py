"""Expert parallelism over the tensor-parallel ranks: each rank holds whole experts of every bank placed
``PlacementKind.EXPERT`` (its ``E/ep`` consecutive experts) and computes their rows only.

A grouped matmul ``grouped_mm(x, W, offs)`` multiplies the rows of ``x`` (sorted by expert; ``offs`` the
cumulative row count of each) by their expert's matrix. The tokens are whole on every tensor-parallel rank, so
each rank computes the rows of its own experts (``local_grouped_mm``), zeros elsewhere, and a chain of grouped
matmuls (gate-up, then down) becomes a sum over the ranks: Megatron's ``g`` (all-reduce) after the chain's last
matmul, its ``f`` (all-reduce of the gradient) on the chain's input. Between them a rank's rows of other experts
are never read by a later matmul, so what ops between compute on them does not matter; in backward, the rows of
other experts get no gradient from a rank, and the ``f`` sums each row's from the rank that owns its expert.
Each expert's weights get their whole gradient on the rank holding them, from every token routed to it.
"""

from __future__ import annotations

import torch
from torch import fx, nn

from autotp.passes.placement import PlacementKind, chunk_span
from autotp.passes.projections import grouped_ops
from autotp.rewrite.collectives import CopyToTP, ReduceFromTP

aten = torch.ops.aten

_CHAIN_DEPTH = 12
"""How many ops may lie between two grouped matmuls of one chain (an activation, a product of halves, a cast)."""


def local_grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, first: int) -> torch.Tensor:
    """``grouped_mm(x, W, offs)``'s rows of experts ``first`` to ``first + len(w) - 1`` (``w``: their matrices),
    zeros for the rows of other experts."""
    out = x.new_zeros((x.shape[0], w.shape[-1]))
    ends = offs.tolist()
    starts = [0, *ends[:-1]]
    for j in range(w.shape[0]):
        # even with no rows: the output must reach x and w in autograd on every rank, or a rank whose experts got
        # no token would skip the f's all-reduce in backward that the others run
        a, b = starts[first + j], ends[first + j]
        out[a:b] = torch.mm(x[a:b], w[j])
    return out


def _bank(weight: fx.Node) -> fx.Node | None:
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
        bank = _bank(mm.args[1])
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


def _offsets(mm: fx.Node) -> fx.Node:
    return mm.args[2] if len(mm.args) > 2 else mm.kwargs["offs"]


def expert_matmuls(graph: fx.Graph, targets) -> list[tuple[fx.Node, bool, bool]]:
    """Each grouped matmul over a bank among ``targets`` (``get_attr`` targets split by their experts), with whether
    it starts its chain (no other such matmul reaches its rows: ``f`` there) and whether it ends it (its output
    reaches no other: ``g`` there)."""
    mms = [mm for mm in grouped_matmuls(graph) if (bank := _bank(mm.args[1])) is not None and bank.target in targets]
    chosen = set(mms)
    return [(mm, not any(_reaches(other, {mm}) for other in chosen - {mm}), not _reaches(mm, chosen - {mm}))
            for mm in mms]


def split_experts(gm: fx.GraphModule, placements: dict[str, object], rank: int, tp: int, comm) -> None:
    """Make this rank's graph compute only its experts' rows of every grouped matmul whose bank is placed
    ``EXPERT`` (``placements``: ``get_attr`` target -> placement), with ``f`` before and ``g`` after each chain."""
    for count, (mm, first_of_chain, last_of_chain) in enumerate(expert_matmuls(gm.graph, placements)):
        experts = int(_bank(mm.args[1]).meta["val"].shape[0])
        first, _ = chunk_span(experts, tp, rank)
        x, w, offs = mm.args[0], mm.args[1], _offsets(mm)
        mm.target, mm.args, mm.kwargs = local_grouped_mm, (x, w, offs, first), {}
        if first_of_chain:
            name = f"autotp_expert_f_{count}"
            gm.add_submodule(name, CopyToTP(comm))
            with gm.graph.inserting_before(mm):
                mm.args = (gm.graph.call_module(name, (x,)), *mm.args[1:])
        if last_of_chain:
            name = f"autotp_expert_g_{count}"
            gm.add_submodule(name, ReduceFromTP(comm))
            users = list(mm.users)
            with gm.graph.inserting_after(mm):
                summed = gm.graph.call_module(name, (mm,))
            for user in users:
                user.replace_input_with(mm, summed)
    gm.graph.lint()
    gm.recompile()


def expert_placements(captured, plan) -> dict[str, object]:
    """The placements of ``plan`` that split a bank by its experts, keyed by the ``get_attr`` target it is read
    through in ``captured``'s graph."""
    return {captured.attr_target(captured.aliases.get(n, n)): p for n, p in plan.placements.items()
            if p.kind is PlacementKind.EXPERT}
