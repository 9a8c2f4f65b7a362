"""The region search over a whole graph: each group of sibling projections tried in graph order, then what is left.

``regions.RegionFinder`` judges one group at a time; this module orders the groups (a region that would
all-reduce a wider value than it splits is tried last), collects what formed none and why, and hands what is left
to the searches that split a projection or a grouped convolution alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from autotp.passes.group_splits import lone_grouped_convolutions
from autotp.passes.openings import Opening, open_at_grouped_convolutions
from autotp.passes.projections import Projection
from autotp.passes.region_match import RegionMatch
from autotp.passes.regions import RegionFinder
from torch import fx


def _sibling_groups(projections: dict[str, Projection], skip: set[str]) -> list[list[Projection]]:
    """Projections grouped by the tensor they read, in graph order; groups that use one parameter are one group
    (each expert's matrix of a bank, ``W[e]``, reads its own tokens: the experts split together or not at all)."""
    parent: dict[tuple, tuple] = {}

    def root(key: tuple) -> tuple:
        while parent.setdefault(key, key) != key:
            key = parent[key]
        return key

    kept = [p for p in projections.values() if p.node not in skip]
    for p in kept:  # the tensor read and the weight used join one group
        parent[root(("weight", p.weight))] = root(("input", p.input))
    groups: dict[tuple, list[Projection]] = {}
    for p in kept:
        groups.setdefault(root(("input", p.input)), []).append(p)
    return list(groups.values())


def _widens(region: RegionMatch, projections: dict[str, Projection]) -> bool:
    """Whether the region all-reduces a wider value than the one it splits: a narrow down-projection split by
    columns and the up-projection after it by rows (low-rank attention's ``q_a`` then ``q_b``). Splitting the
    up-projection by columns instead, in the region after it (heads, to the output projection), costs less."""
    return bool(region.columns) and (max(projections[r].out_features for r in region.rows)
                                     > sum(projections[c].out_features for c in region.columns))


@dataclass
class RegionSearch:
    """Regions found, and the projection groups that formed none (with the reason)."""

    regions: list[RegionMatch]
    unmatched: list[tuple[tuple[str, ...], str]]
    openings: list[Opening] = field(default_factory=list)
    """Grouped convolutions reading whole values that open no region, with why (``openings``)."""


def find_regions(graph: fx.Graph, projections: dict[str, Projection], embeddings: dict, trainable: set[str],
                 tp: int, skip: set[str] = frozenset(), whole: set[str] = frozenset(),
                 grad: set[str] | None = None, adapters: dict[str, str] | None = None) -> RegionSearch:
    """Every column→row region of ``graph`` for ``tp`` ranks, in graph order.

    A region whose sizes do not divide by tp is still returned, with ``violations`` set, so the
    planner can say which layer and size are at fault. ``skip``: projections planned elsewhere (the LM
    heads); ``whole``: projections that are never split alone (kept whole by choice); ``grad``: the nodes
    gradients flow through (``graph.grad_nodes``), when known; ``adapters``: low-rank adapters' down- and
    up-projections by their base projection (``adapters``), which no region claims: the planner places them by
    their base layers, and a region's trial splits an up-projection with its base's columns.
    """
    finder = RegionFinder(graph, projections, embeddings, trainable, tp, grad)
    adapters = adapters or {}
    claimed = finder.claimed = set(skip) | {n for parts in adapters.values() for n in parts}
    finder.adapter_ups = {base: up for base, (_, up) in adapters.items()}
    finder.heads = set(skip)
    search = RegionSearch([], [])
    widening: list[list[Projection]] = []

    def search_group(group: list[Projection], last: bool) -> None:
        group = [p for p in group if p.node not in claimed]
        if not group:
            return
        region = finder.find(group)
        set_aside, finder.set_aside = finder.set_aside, []
        if not isinstance(region, str) and _widens(region, projections):
            if not last:  # tried again once the others are placed
                widening.append(group)
                return
            if claimed & {*region.rows, *region.columns}:
                set_aside = []  # what blocked parts of this group no longer matters: the group as a whole is out
                region = ("the only region it closes all-reduces a wider value than the one it splits (the "
                          "up-projections after it are split by columns instead)")
        search.unmatched += set_aside
        if isinstance(region, str):
            search.unmatched.append((tuple(p.node for p in group), region))
        else:
            search.regions.append(region)
            claimed.update(region.rows, region.columns)

    for group in _sibling_groups(projections, claimed):
        search_group(group, last=False)
    for group in widening:
        search_group(group, last=True)
    # A group tried alone may have been split later with the region that reaches it (K/V of cross-attention).
    search.unmatched = [(nodes, finder.explain(why)) for nodes, why in search.unmatched
                        if not claimed.issuperset(nodes)]
    open_at_grouped_convolutions(finder, search, claimed)
    # What is left and only reads and writes whole values is split alone, by its input features, unless it is
    # kept whole on purpose (``choices``).
    rows = [row for nodes, why in search.unmatched for n in nodes if n not in claimed and n not in whole
            and (row := finder.lone_row(projections[n], why)) is not None]
    search.regions += rows
    claimed.update(n for r in rows for n in r.rows)
    search.unmatched = [(kept, why) for nodes, why in search.unmatched
                        if (kept := tuple(n for n in nodes if n not in claimed))]
    placed = ({projections[n].weight for n in claimed if n in projections}
              | {t for r in search.regions for t, _ in r.params})
    # a grouped convolution an opening kept whole by choice (a gather to save a few multiply-adds) stays whole
    placed |= {finder.nodes[o.node].args[1].target for o in search.openings if o.by_choice}
    lone, kept = lone_grouped_convolutions(graph, projections, embeddings, trainable, tp, finder.grad, finder.index,
                                           finder.decisions, placed)
    search.regions += lone
    search.openings += [Opening(node, why=why, by_choice=True) for node, why in kept.items()]
    return search

