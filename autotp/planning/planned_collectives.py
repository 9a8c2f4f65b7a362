"""The collectives a plan's placements imply, listed for people and cost models (``Plan.collectives``).

Propagation says where a value changes layout (``conversions``) and where a partial value is reduced
(``reduced``); each such place runs the ``Operator``'s collectives (``passes.steps.COMMUNICATION``), listed
here in graph order with the shape they send, written in the capture's readable size names (``B*T``).
"""

from __future__ import annotations

import functools

import sympy

from autotp.passes.analysis import Analysis
from autotp.passes.graph import named_arg, sizes
from autotp.passes.propagation import Propagation
from autotp.passes.steps import COMMUNICATION, CollectiveOp, Direction, Operator, fused
from autotp.planning.plan import Collective
from autotp.passes.embedding_adapters import joined_lookups
from autotp.passes.grouped_banks import expert_matmuls
from autotp.planning.loop_collectives import loop_collectives


def planned_collectives(analysis: Analysis, prop: Propagation, split_banks=frozenset(),
                        ep: int = 1) -> list[Collective]:
    """The collectives the rewrite will insert, in graph order, for people and cost models (``split_banks``: the
    ``get_attr`` targets of banks split by their experts among ``ep`` ranks)."""
    order = {name: i for i, name in enumerate(analysis.nodes)}
    grad = analysis.grad
    found = [(order[conv.source], c) for conv in prop.conversions.values() for step in fused(conv.steps)
             for reader, in_step in _readers_by_step(analysis, conv)
             for c in _collectives_of(analysis, step.operator, conv.source, reader, grad, in_step)]
    joined = {lookup for lookups in joined_lookups(analysis, prop).values() for lookup in lookups}
    joined |= {rider for riders in prop.riders.values() for rider in riders}  # in their carrier's (``dora_norms``)
    found += [(order[node], c) for node, operator in prop.reduced.items() if node not in joined  # in its base's
              for c in _collectives_of(analysis, operator, node, node, grad)]
    found += [(order[node], c) for node, c in expert_chains(analysis, split_banks, prop.tp, ep)]
    readable = functools.partial(_readable, names=tuple(sorted(analysis.captured.dim_names.items())))
    found += [(order[node], c) for node, c in loop_collectives(analysis, split_banks, prop.tp, ep, readable)]
    listed = [c for _, c in sorted(found, key=lambda item: item[0])]
    return listed + _gradient_bucket(analysis, prop)


BUCKET = "(gradient bucket)"
"""The module named for the end-of-backward bucket, which belongs to no one module."""


def _gradient_bucket(analysis: Analysis, prop: Propagation) -> list[Collective]:
    """The one all-reduce summing, at the end of the backward, the gradient shares of every parameter read through
    ``GRAD_SUM`` (``rewrite.grad_bucket``), sized as all of them together; none when there is none."""
    sources = sorted({conv.source for conv in prop.conversions.values()
                      if any(step.operator is Operator.GRAD_SUM for step in conv.steps) and conv.source in analysis.grad})
    if not sources:
        return []
    numel = sympy.Add(*[sympy.Mul(*[sympy.sympify(d) for d in sizes(analysis.nodes[s])]) for s in sources])
    return [Collective(CollectiveOp.ALL_REDUCE, Direction.BACKWARD, Operator.GRAD_SUM, BUCKET, (str(numel),))]


def expert_chains(analysis: Analysis, split_banks, tp: int, ep: int) -> list[tuple[str, Collective]]:
    """The collectives of the chains of grouped matmuls over banks split by their experts (``get_attr`` targets
    ``split_banks``) among ``ep`` ranks (``rewrite.expert_dispatch``), each at the node it is listed at: the routed
    counts all-gathered; the dispatch and combine all-to-alls, each carrying this rank's share of the routed rows
    (top-k x tokens x hidden over tp ranks, at balanced routing) both ways; at tp > 1 the all-gathers of the
    shares (the output rows forward, the input rows' gradient backward)."""
    out = []
    for mm, first, last in expert_matmuls(analysis.graph, split_banks):
        if first:
            rows = mm.args[0].name
            experts = int(mm.args[1].meta["val"].shape[0])
            layer = analysis.layer(rows)
            out.append((rows, Collective(CollectiveOp.ALL_GATHER, Direction.FORWARD, Operator.ROUTE, layer,
                                         (str(ep), str(experts)), itemsize=8)))
            out += [(rows, c) for c in _shared(analysis, Operator.DISPATCH, rows, tp, layer)]
            if tp > 1:
                out += [(rows, c) for c in _collectives_of(analysis, Operator.SCATTER, rows, rows, analysis.grad)]
        if last:
            out += [(mm.name, c) for c in _shared(analysis, Operator.COMBINE, mm.name, tp, analysis.layer(mm.name))]
            if tp > 1:
                out += [(mm.name, c) for c in _collectives_of(analysis, Operator.GATHER, mm.name, mm.name, set())]
    return out


def _shared(analysis: Analysis, operator: Operator, rows: str, tp: int, layer: str) -> list[Collective]:
    """``operator``'s all-to-alls of a tp rank's share of ``rows``."""
    first, *rest = _shape(analysis, rows)
    share = (str(sympy.sympify(first) / tp), *rest)
    return [Collective(c.op, c.direction, operator, layer, share) for c in COMMUNICATION[operator]]


def _readers_by_step(analysis: Analysis, conv) -> list[tuple[str, bool]]:
    """One reader of ``conv`` per copy the rewrite inserts, with whether a training step runs it: a model
    output's gather is inserted apart from the one the graph's other readers use, and the step defers it."""
    inside, outputs = conv.by_reader(analysis.graph.output_node().name)
    return [*([(inside[0][0], True)] if inside else []), *([(outputs[0][0], False)] if outputs else [])]


def _collectives_of(analysis: Analysis, operator: Operator, value: str, reader: str, grad: set[str],
                    in_step: bool = True) -> list[Collective]:
    """The collectives ``operator`` runs on ``value`` (one per pass it communicates in, none backward when no
    gradient flows through ``value``: slices of token ids), each listed at the value or at its ``reader``."""
    shape = _communicated_shape(analysis, operator, value)
    return [Collective(comm.op, comm.direction, operator, analysis.layer(value if comm.at_source else reader), shape,
                       in_step=in_step) for comm in COMMUNICATION[operator]
            if comm.direction is Direction.FORWARD or value in grad]


def _communicated_shape(analysis: Analysis, operator: Operator, value: str) -> tuple[str, ...]:
    """The shape of what ``operator`` sends for ``value``: the value, except for a vocab-parallel cross-entropy,
    which sends three statistics (max, sum of exponentials, target logit) per target, four with label smoothing
    (each rank's sum of logits too)."""
    if operator is Operator.CROSS_ENTROPY:
        node = analysis.nodes[value]
        stats = "4" if named_arg(node, "label_smoothing", 0.0) else "3"
        return (*_shape(analysis, node.args[1].name), stats)
    if operator is Operator.RUNNING_STATS:  # the running mean and variance of every channel
        return ("2", *_shape(analysis, analysis.nodes[value].args[3].name))
    return _shape(analysis, value)


def _shape(analysis: Analysis, node_name: str) -> tuple[str, ...]:
    """A node's shape with the capture's size symbols renamed (``s70*s72`` -> ``B*T``)."""
    names = tuple(sorted(analysis.captured.dim_names.items()))
    return tuple(_readable(d, names) for d in sizes(analysis.nodes[node_name]))


@functools.lru_cache(maxsize=4096)
def _readable(size, names: tuple[tuple[str, str], ...]) -> str:
    """``size`` with the size symbols renamed by ``names`` (symbol name -> readable name), found once per size: the
    collectives of every block repeat their shapes."""
    expr = sympy.sympify(size)  # shape-env symbols carry assumptions: match them by name
    renamed = dict(names)
    return str(expr.subs({s: sympy.Symbol(renamed[s.name]) for s in expr.free_symbols if s.name in renamed}))
