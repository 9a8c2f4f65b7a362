"""The collectives of a loop over the experts split by them (``rewrite.loop_dispatch``), listed as those of a chain
of grouped matmuls are (``planned_collectives.expert_chains``): the routed counts all-gathered, then a dispatch and
a combine all-to-all of a tp rank's share of every routed row (top-k x tokens x hidden over tp, at balanced
routing) each way; at tp > 1 the all-gathers of the shares (the output rows forward, the input rows' gradient
backward). The rows of all the experts travel together, so they are counted from the tokens the loop reads and
the router's top-k, not from one expert's rows (whose count is the batch's routing)."""

from __future__ import annotations

import sympy
import torch

from autotp.passes.analysis import Analysis
from autotp.passes.graph import sizes
from autotp.passes.loop_banks import bank_loops
from autotp.passes.routed_experts import expert_layers
from autotp.passes.steps import COMMUNICATION, CollectiveOp, Direction, Operator
from autotp.planning.plan import Collective

aten = torch.ops.aten


def _tokens(rows):
    """The token rows an expert's rows are picked from (``x[tokens]``), through casts; None if not found."""
    while rows is not None and rows.op == "call_function":
        if rows.target is aten.index.Tensor:
            return rows.args[0]
        rows = rows.args[0] if rows.args and hasattr(rows.args[0], "op") else None
    return None


def loop_collectives(analysis: Analysis, split_banks, tp: int, ep: int, readable) -> list[tuple[str, Collective]]:
    """Each split loop's collectives, at the node it is listed at (``readable(size)``: a size in the capture's
    names)."""
    out = []
    layers = expert_layers(analysis)
    for loop in bank_loops(analysis.graph)[0]:
        if not all(t in split_banks for t in loop.banks):
            continue
        first, last = loop.chains[0], loop.chains[-1]
        tokens = _tokens(first.rows)
        if tokens is None:
            continue
        layer = analysis.layer(first.rows.name)
        k = next((x.top_k for x in layers if x.owns(layer + ".")), 1)
        rows, *rest = (readable(s) for s in sizes(tokens))
        whole = (str(sympy.sympify(rows) * k), *rest)
        share = (str(sympy.sympify(rows) * k / tp), *rest)
        experts = len(loop.chains)
        at, end = first.rows.name, last.end.name
        out.append((at, Collective(CollectiveOp.ALL_GATHER, Direction.FORWARD, Operator.ROUTE, layer,
                                   (str(ep), str(experts)), itemsize=8)))
        for operator, node in ((Operator.DISPATCH, at), (Operator.COMBINE, end)):
            out += [(node, Collective(c.op, c.direction, operator, layer, share)) for c in COMMUNICATION[operator]]
        if tp > 1:
            for operator, node in ((Operator.SCATTER, at), (Operator.GATHER, end)):
                out += [(node, Collective(c.op, c.direction, operator, layer, whole)) for c in COMMUNICATION[operator]]
    return out
