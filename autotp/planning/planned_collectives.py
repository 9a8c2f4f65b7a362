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
from autotp.passes.grouped_banks import expert_matmuls


def planned_collectives(analysis: Analysis, prop: Propagation, split_banks=frozenset()) -> list[Collective]:
    """The collectives the rewrite will insert, in graph order, for people and cost models (``split_banks``: the
    ``get_attr`` targets of banks split by their experts)."""
    order = {name: i for i, name in enumerate(analysis.nodes)}
    grad = analysis.grad
    found = [(order[conv.source], c) for conv in prop.conversions.values() for step in fused(conv.steps)
             for reader, in_step in _readers_by_step(analysis, conv)
             for c in _collectives_of(analysis, step.operator, conv.source, reader, grad, in_step)]
    found += [(order[node], c) for node, operator in prop.reduced.items()
              for c in _collectives_of(analysis, operator, node, node, grad)]
    found += [(order[node], c) for node, operator in expert_chains(analysis, split_banks)
              for c in _collectives_of(analysis, operator, node, node, grad)]
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


def expert_chains(analysis: Analysis, split_banks) -> list[tuple[str, Operator]]:
    """Where the rewrite sums the experts' rows over the ranks for banks split by their experts (``get_attr``
    targets ``split_banks``): ``f`` on each chain's input rows, ``g`` on its output (``rewrite.expert_split``)."""
    out = []
    for mm, first, last in expert_matmuls(analysis.graph, split_banks):
        out += [(mm.args[0].name, Operator.F)] if first else []
        out += [(mm.name, Operator.G)] if last else []
    return out


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
