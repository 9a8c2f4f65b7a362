"""Early verdicts for a lone projection tried as a column split: proof, found near the projection, that the try
can never close a region, so that its walk stops there instead of running to the LM head.

A projection that writes into the residual stream (a mixture of experts' down-projection, deferred behind the
up-projections' region because that region widens) is also tried alone as a column split. Its split then rides the
residual stream through every later block, so each such try walked the rest of the graph, several times over
(``RegionFinder.attempt`` refines until nothing more is learnt): planning grew with depth squared. The try is
dead long before that: right after the projection, its split meets the stream it was computed from
(``h + moe(norm(h))``), which is whole, and must be sliced there (or its own value gathered). Nothing a refinement
learns can change that (``DeadEndWatch``), and a try that slices a value gradients flow through never closes
(``RegionFinder.closed``), so the verdict is known at that node.

Why no refinement changes it. ``attempt`` only ever adds splits (projections grown, parameters split, segments
cut): (1) the values the try's projection reads, and everything they are computed from (``upstream``), stay whole
in every refinement: growing refuses them (``origins.trace``), and a parameter split by a refinement is read by a
node the split reached, which is never upstream, unless a parameter is read in two places (tied or shared
weights): no projection after the first such reader is judged early (``shared_from``). (2) The projection's output is split in every
refinement (its weight is), and so is each value on the path checked here, or the walk gathers: each step is an
op whose rule, given one split input, splits its output along a dim found without the segments, or gathers
(``_carried`` lists them, mirroring their rules). (3) The pointwise op where the path meets a whole upstream value
of its own shape slices that value (``rule_kit.join``), or gathers; the slice cannot be excused as coming from
the region's rows (``RegionFinder._from_rows``), since what made that value is upstream too, and no upstream
projection reads a split. A slice or a gather leaves the try open.
"""

from __future__ import annotations

from collections.abc import Container

import torch
from autotp.passes.graph import named_arg, rank, sizes
from autotp.passes.placement import Shard
from autotp.passes.graph_index import GraphIndex
from autotp.passes.propagation import Propagation
from autotp.passes.reshapes import kept_dim
from autotp.passes.rule_kit import like_first, multi_output, no_output, norm_dim, pointwise
from autotp.passes.rules import rule_for
from autotp.passes.rules_compute import reduction
from autotp.passes.rules_shape import index, reshape
from torch import fx

aten = torch.ops.aten


def shared_from(index: GraphIndex) -> int:
    """The graph position of the first node reading a parameter that another node also reads (tied or shared
    weights), or past the end when none does: a try is judged early only at projections before it, where a
    refinement can never split a parameter the try's own input is computed from. A check with no output
    (``_assert_tensor_metadata``) reads without taking part: its rule converts nothing, so it splits nothing."""
    shared = []
    for readers in index.readers.values():
        taking_part = {r for r in readers if not _only_checks(index.order[r])}
        if len(taking_part) > 1:
            shared.append(min(taking_part))
    return min(shared, default=len(index.order))


def _only_checks(node: fx.Node) -> bool:
    return rule_for(node.target) is no_output and not node.users


def _carried(node: fx.Node, path: tuple, x: fx.Node, dim: int) -> int | None:
    """The output dim ``node``'s rule splits when its input ``x`` (at ``path``) is split along ``dim``, with any
    segments, or None when that rule may also make the output whole without gathering ``x`` (an all-reduce of a
    reduction over ``dim``, a row projection, a rule not listed here). Each case mirrors its rule."""
    rule = rule_for(node.target)
    if rule is pointwise:  # ``aligned``: the split dims agree from the right, or it gathers
        return dim + rank(node) - rank(x)
    if path != (0,):
        return None  # the rules below split like their first input only
    if rule is like_first:
        return dim
    if rule is index:  # one index tensor on dim 0, the split later: after the index's dims; else it gathers
        ids = node.args[1]
        return dim - 1 + rank(ids[0]) if len(ids) == 1 and isinstance(ids[0], fx.Node) and dim != 0 else None
    if rule is reshape:  # a dim the reshape leaves as it is: there, or it gathers (``map_reshape``)
        return kept_dim(sizes(x), sizes(node), dim)
    if rule is reduction and not multi_output(node):  # over other dims: kept, or moved past the reduced ones
        dims = named_arg(node, "dim", None)
        if dims is None or dims == []:
            return None
        dims = [norm_dim(d, rank(x)) for d in ([dims] if isinstance(dims, int) else dims)]
        if dim in dims:
            return None  # a sum over the split dim is all-reduced: the split ends there
        return dim if named_arg(node, "keepdim", False) else dim - sum(d < dim for d in dims)
    return None


class DeadEndWatch:
    """Watches the first walk of a lone column try (``propagate``'s ``stop``), in graph order, and stops it at the
    first proof that no refinement of the try closes a region (the module docstring): ``proof`` is then (the
    pointwise node, the upstream value it slices)."""

    def __init__(self, column: fx.Node, dim: int, upstream: Container[str], grad: Container[str],
                 special: Container[str], index: GraphIndex):
        self.split = {column.name: dim}
        """Values split in every refinement of the try (or it gathers), with the dim: the path from the column."""
        self.upstream, self.grad, self.special, self.index = upstream, grad, special, index
        self.proof: tuple[str, str] | None = None

    def __call__(self, node: fx.Node, result: Propagation) -> bool:
        """Whether the walk may stop after visiting ``node``."""
        dim = self._split_dim(node, result)
        if dim is None:
            return False
        self.split[node.name] = dim
        pinned = self._pinned(node, dim) if rule_for(node.target) is pointwise else None
        if pinned is not None:
            self.proof = (node.name, pinned.name)
        return pinned is not None

    def _split_dim(self, node: fx.Node, result: Propagation) -> int | None:
        """``node``'s split dim when it is on the path (an input on it carried by a listed rule, to the dim this
        walk found), else None. Projections and embeddings have their own decisions: never on the path."""
        lay = result.layouts.get(node.name)
        if node.op != "call_function" or node.name in self.special or not isinstance(lay, Shard):
            return None
        for path, x, _ in self.index.args(node):
            if x.name in self.split and _carried(node, path, x, self.split[x.name]) == lay.dim:
                return lay.dim
        return None

    def _pinned(self, node: fx.Node, dim: int) -> fx.Node | None:
        """A whole input of pointwise ``node`` that every refinement slices there (``join``): upstream, so whole;
        gradients flow through it; as large as the output along ``dim``, so not broadcast; not an ``expand``
        (``split_broadcast`` would split its input instead) nor a parameter (which a refinement may split)."""
        for _, s, tensor in self.index.args(node):
            if (tensor and s.name not in self.split and s.op == "call_function"
                    and s.target is not aten.expand.default and s.name in self.grad and rank(s) == rank(node)
                    and not sizes(s)[dim] == 1 and s.name in self.upstream):
                return s
        return None


class Unexplained(str):
    """The reason a group closes no region, not yet put into words: a try judged early (``DeadEndWatch``) stops
    before the walk that words it. Most such groups are claimed later (as another region's rows) and their reason
    is dropped; ``find_regions`` words the others at the end with the full try, against ``claimed`` as it was."""

    group: tuple[str, ...]
    """The group's projection nodes."""
    claimed: frozenset[str]

    def __new__(cls, group: tuple[str, ...], claimed: set[str]):
        made = super().__new__(cls, "(a lone try stopped early; its reason is worded at the end of the search)")
        made.group, made.claimed = group, frozenset(claimed)
        return made
