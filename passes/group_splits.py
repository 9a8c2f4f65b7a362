"""Grouped convolutions between whole values, split alone by whole groups.

A grouped convolution of a whole input (wav2vec2's positional convolution reads the residual stream and its
output is added back to it) is in no column→row region: nothing split reaches it. Split by the output channels of
whole groups, each rank's groups read only their own input channels: the rank slices those from the whole input
(no communication forward; the input's gradient all-gathered backward), convolves them with its rows of the weight,
and the output is gathered where a whole value needs it. The weight may be computed from a parameter (weight
normalisation, ``capture.weight_norms``): the parameter of the weight's shape is split along its first dim, and
the propagation carries that through the ops in between (a norm over the split dim all-reduced).
"""

from __future__ import annotations

from autotp.passes.choices import convolution_weight
from autotp.passes.graph import sizes
from autotp.passes.placement import Shard
from autotp.passes.projections import is_grouped_convolution
from autotp.passes.graph_index import GraphIndex
from autotp.passes.propagate import propagate
from autotp.passes.propagation import Propagation
from autotp.passes.region_match import RegionKind, RegionMatch
from autotp.passes.steps import Operator
from torch import fx


MAX_GATHERS = 1
"""A split made whole more than once (a residual stream kept split through later layers, each gathering it
again) costs more than it saves: such a convolution is kept whole."""


def _accepted(prop: Propagation, conv: fx.Node) -> bool:
    """Whether a propagation of the split is worth planning: the convolution itself split, nothing the rewrite
    cannot make exact, no projection reached, and made whole at most ``MAX_GATHERS`` times (sizes tp does not
    divide are the planner's to report)."""
    return (isinstance(prop.layouts.get(conv.name), Shard) and not prop.refusals and not prop.rows
            and len(prop.steps_of(Operator.GATHER)) <= MAX_GATHERS)


def _propagated(graph, projections, embeddings, trainable, tp, grad, index, decisions,
                layouts: dict[str, Shard]) -> tuple[Propagation, dict[str, Shard]]:
    """The propagation of ``layouts``, with every trainable parameter it slices (the convolution's bias) split
    too, until nothing more is learnt."""
    nodes = index.nodes
    for _ in range(4):
        prop = propagate(graph, projections, embeddings, layouts, tp, trainable, grad=grad, index=index,
                         windowed=True, decisions=decisions)
        sliced = {nodes[c.source].target: c.steps[0].shard for c in prop.steps_of(Operator.SCATTER)
                  if len(c.steps) == 1 and nodes[c.source].op == "get_attr" and nodes[c.source].target in trainable}
        if sliced.keys() <= layouts.keys():
            break
        layouts = layouts | sliced
    return prop, layouts


def _gathered_too_often(prop: Propagation, conv: fx.Node) -> str | None:
    """Why ``conv``'s exact split is not worth making: made whole more than ``MAX_GATHERS`` times; else None."""
    gathers = len(prop.steps_of(Operator.GATHER))
    if not isinstance(prop.layouts.get(conv.name), Shard) or prop.refusals or prop.rows or gathers <= MAX_GATHERS:
        return None
    return (f"a grouped convolution whose input is whole: split by whole groups, its output would have to be made "
            f"whole again {gathers} times per step (all-gathers, and their gradients' slices back) to save each rank a "
            "few multiply-adds; it runs whole on every rank, as a norm between Megatron's regions does")


def lone_grouped_convolutions(graph: fx.Graph, projections: dict, embeddings: dict, trainable: set[str], tp: int,
                              grad: set[str], index: GraphIndex, decisions: dict,
                              placed: set[str]) -> tuple[list[RegionMatch], dict[str, str]]:
    """A region for each grouped convolution whose weight parameter no region placed (``placed``: ``get_attr``
    targets) and whose split by whole groups is exact and gathered at most ``MAX_GATHERS`` times. One that tp does
    not divide comes back with its violations (the planner keeps it whole, with a note). Also, by node, why the
    ones whose exact split would be gathered more often are kept whole (a choice: a cost)."""
    out, kept = [], {}
    for conv in graph.nodes:
        if not is_grouped_convolution(conv):
            continue
        param = convolution_weight(conv, trainable)
        if param is None or param.target in placed:
            continue
        layouts = {param.target: Shard(0, (int(sizes(param)[0]),))}
        prop, layouts = _propagated(graph, projections, embeddings, trainable, tp, grad, index, decisions, layouts)
        if not _accepted(prop, conv):
            why = _gathered_too_often(prop, conv)
            if why:
                kept[conv.name] = why
            continue
        placed.update(layouts)
        out.append(RegionMatch(kind=RegionKind.CONVOLUTION, columns=(), rows=(), segments=(),
                               params=tuple(layouts.items()), violations=tuple(prop.violations),
                               sizes=tuple(prop.checked), convolutions=(conv.name,)))
    return out, kept
