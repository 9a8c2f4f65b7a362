"""Regions that open at a grouped convolution, and the grouped convolutions kept whole on purpose.

A column projection reads a whole value and writes a split one with no communication going forward. A grouped
convolution can too: each rank reads only its own channels of its whole input (a free slice; backward, the
input's gradient is gathered, as a lone row's is) and convolves its own groups. So where a grouped convolution
reads a whole value (the residual stream after an all-reduce) and its split output reaches, through per-channel
ops (norms, activations, other grouped convolutions), only projections that take it split by their input
channels, it opens a region those close as rows: a depthwise-separable block (depthwise, then pointwise) split
with one all-reduce.

Where the split output would have to be made whole again before any projection takes it (a LayerNorm over the
channels, a projection split by its output features in the region after it), splitting would add an all-gather
of its output per step, to save each rank a few multiply-adds per output value (k² per channel for a depthwise
convolution, the group's width times k² for a grouped one). It runs whole on every rank, as a norm between
Megatron's regions does: kept whole by choice, with that reason (``Opening.why``).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from autotp.passes.graph import sizes
from autotp.passes.placement import Shard
from autotp.passes.projections import is_grouped_convolution
from autotp.passes.propagation import Propagation
from autotp.passes.region_match import RegionKind, RegionMatch
from autotp.passes.steps import Operator
from torch import fx


@dataclass(frozen=True)
class Opening:
    """A grouped convolution tried as the start of a region: the region, or why it closes none (``by_choice``:
    the reason is a cost, the all-gather its split would add; otherwise no exact split reaches it)."""

    node: str
    region: RegionMatch | None = None
    why: str = ""
    by_choice: bool = False


def grouped_convolutions(graph: fx.Graph) -> list[fx.Node]:
    """The grouped (not dense, not transposed) convolutions of a parameter, in graph order."""
    return [n for n in graph.nodes if is_grouped_convolution(n)
            and isinstance(n.args[1], fx.Node) and n.args[1].op == "get_attr"]


def open_at_grouped_convolutions(finder, search, claimed: set[str]) -> None:
    """Regions opened at the grouped convolutions no region split, added to ``search`` (the region search's
    ``RegionSearch``, ``finder`` its ``RegionFinder``); those that open none are kept in ``search.openings`` with
    why. Run before the lone rows: a projection a grouped convolution's split reaches is better closed as its row,
    the convolution split too, than split alone."""
    split = {t for r in search.regions for t, _ in r.params}
    for conv in grouped_convolutions(finder.graph):
        if conv.args[1].target in split:
            continue  # its input arrives split by a region
        opening = try_opening(finder, conv, claimed)
        if opening.region is None:
            search.openings.append(opening)
            continue
        search.regions.append(opening.region)
        claimed.update(opening.region.rows, opening.region.columns)
        split.update(t for t, _ in opening.region.params)


def try_opening(finder, conv: fx.Node, claimed: set[str]) -> Opening:
    """``conv`` (a grouped convolution reading a whole value) split by its output channels, with what that split
    reaches learnt as the region search learns a column's (``RegionFinder.attempt``: the parameters it meets, the
    projections whose whole outputs it would slice, a squeeze-and-excitation gate's): the region it opens, or why
    none. ``claimed``: projections other regions split already (a split reaching one as a row would change it)."""
    weight = conv.args[1]
    seed = {weight.target: Shard(0, (int(sizes(weight)[0]),))}
    prop, columns, segments, params = finder.attempt([], finder.tp, seed=seed, reads=(conv.args[0],))
    why = _open(finder, prop, conv, claimed)
    if why is None:  # the projections grown as columns are unclaimed (``_feeding`` leaves claimed ones out)
        return Opening(conv.name, region=dataclasses.replace(finder.match(columns, prop, segments, params),
                                                             kind=RegionKind.CONVOLUTION))
    return Opening(conv.name, why=why[0], by_choice=why[1])


def _open(finder, prop: Propagation, conv: fx.Node, claimed: set[str]) -> tuple[str, bool] | None:
    """None when ``prop`` (``conv``'s split) closes a region on its own; else why not, and whether the reason is
    the cost of an all-gather (a choice) rather than a split no rewrite makes exact."""
    if prop.refusals:
        return prop.refusals[0][1], False
    if prop.violations:
        v = prop.violations[0]
        return f"its {v.what} ({v.size}) do not divide by tp={finder.tp}", False
    taken = [r for r in prop.rows if r in claimed or r in finder.heads]
    gathered = prop.steps_of(Operator.GATHER)
    sliced = [c for c in finder._sliced(prop)
              if c.source != conv.args[0].name or {n for n, _ in c.consumers} != {conv.name}]
    if not (taken or gathered or sliced) and prop.rows:
        return None
    if not (taken or gathered):
        if sliced:
            return "its split would slice another value gradients flow through", False
        return "no projection downstream takes its split output as input", False
    at = "a projection another region splits by its output features" if taken else _reader(finder, gathered[0])
    return (f"a grouped convolution ({_macs(conv)} multiply-adds per output value) whose input is whole: split by "
            f"its channels, its output would have to be made whole again at {at}, an all-gather per step (and its "
            "gradient's slice back) to save each rank a few multiply-adds; it runs whole on every rank, as a norm "
            "between Megatron's regions does"), True


def _reader(finder, conversion) -> str:
    consumer = finder.nodes[conversion.consumers[0][0]]
    return getattr(consumer.target, "__name__", str(consumer.target))


def _macs(conv: fx.Node) -> int:
    """Multiply-adds per output value: the weight's input channels per group times its kernel size."""
    return math.prod(int(s) for s in sizes(conv.args[1])[1:])
