"""Find the regions Megatron splits: column-split projections closed by row-split ones.

Projections that read the same tensor (Q/K/V, gate/up, or one fused QKV) are tried as column-split
together; sharding propagation then shows where the split values go. A region is found when every
path ends in a projection that takes the split features as its input (the row-split one) with no
gather or slice on the way. Attention and MLP are told apart by what lies between (attention ops,
a product of two split branches), never by names.
"""

from __future__ import annotations

from collections.abc import Container

import torch
from autotp.passes.dead_ends import DeadEndWatch, Unexplained, shared_from
from autotp.passes.graph import grad_nodes
from autotp.passes.origins import Ancestors, SourceGraph, repeated, trace
from autotp.passes.placement import Shard
from autotp.passes.expert_banks import per_expert
from autotp.passes.projections import Projection, packed_by_weight, packed_segments
from autotp.passes.graph_index import GraphIndex
from autotp.passes.adapters import by_up, up_projections, ups_beside
from autotp.passes.propagate import propagate
from autotp.passes.propagation import Propagation
from autotp.passes.region_match import RegionKind, RegionMatch
from autotp.passes.rule_kit import like_first
from autotp.passes.rules import rule_for
from autotp.passes.rules_shape import permute, reshape
from autotp.passes.steps import Operator
from torch import fx

aten = torch.ops.aten
_ATTENTION_OPS = {aten.scaled_dot_product_attention.default, aten.softmax.int, aten._softmax.default}


def _layouts(columns: list[Projection], segments: dict[str, tuple[int, ...]],
             shared: dict[str, int] | None = None) -> dict[str, Shard]:
    shared = shared or {}
    out = {p.weight: Shard(p.out_dim, per_expert(p, segments.get(p.node) or (p.out_features,)),
                           replicas=shared.get(p.node, 1))
           for p in columns if p.packed is None}
    for weight, packed in packed_by_weight(columns).items():
        parts = packed_segments(packed, segments)
        if parts is not None:  # slices that do not tile the parameter leave it whole
            out[weight] = Shard(packed[0].out_dim, parts)
    return out


def _classify(graph_nodes: dict[str, fx.Node], prop: Propagation) -> RegionKind:
    sharded = [graph_nodes[n] for n, lay in prop.layouts.items() if isinstance(lay, Shard) and n in graph_nodes]
    if any(n.target in _ATTENTION_OPS for n in sharded):
        return RegionKind.ATTENTION
    def two_branches(n: fx.Node) -> bool:
        # A product of two split values that come from different projections: a gate.
        branches = {prop.origins.get(a.name) for a in n.all_input_nodes if isinstance(prop.layouts.get(a.name), Shard)}
        return len(branches) == 2

    gated = any(n.target is aten.mul.Tensor and two_branches(n) for n in sharded)
    return RegionKind.GATED_MLP if gated else RegionKind.MLP


class RegionFinder:
    """Judges one group of sibling projections at a time (``find``): the region it opens, or why none; what it
    learns about the graph (rule decisions, traces, propagations) is shared by every group of one search."""

    def __init__(self, graph, projections, embeddings, trainable, tp, grad=None):
        self.graph, self.projections, self.embeddings = graph, projections, embeddings
        self.trainable, self.tp = trainable, tp
        self.nodes = {n.name: n for n in graph.nodes}
        self.grad = grad_nodes(graph, trainable) if grad is None else grad
        self.index = GraphIndex.of(graph)
        self.decisions: dict = {}
        """Rule decisions by node and input layouts, shared by every candidate's propagation (``propagate``)."""
        self.propagations: dict = {}
        """The last few candidates' propagations, by layouts (``_propagate``)."""
        self.traced: dict = {}
        """Traces of sliced values with nothing upstream excluded (``_from_rows``), by value and split."""
        self.claimed: set[str] = set()
        self.heads: set[str] = set()
        """The vocabulary heads: a split that reaches one as its row has split the residual stream."""
        self.adapter_ups: dict[str, str] = {}
        """Adapters' up-projections by base projection (``adapters``): split with the base's columns."""
        self.sources = SourceGraph(projections, embeddings, self.grad, trainable, tp)
        self.set_aside: list[tuple[tuple[str, ...], str]] = []
        """Projections left out of a group's region because they blocked it, and why."""
        self.shared_from = shared_from(self.index)
        """Lone tries are judged early only before this graph position (``dead_ends.shared_from``)."""

    def attempt(self, group: list[Projection], tp: int, grow: bool = True, shared: dict[str, int] | None = None,
                seed: dict[str, Shard] | None = None, reads: tuple[fx.Node, ...] = (),
                segments: dict[str, tuple[int, ...]] | None = None) -> tuple[Propagation, list[Projection], dict, dict]:
        """Propagate with ``group`` column-split (and the parameters ``seed`` split, reading ``reads``: a grouped
        convolution a region opens at, ``openings``); refine until nothing more is learnt.

        A split that cuts the output into parts makes the projection fused (segments); a parameter
        that would be sliced where it meets a split value (a bias added after ``x @ W``) is split too;
        with ``grow``, so is a projection whose whole output would be sliced there (cross-attention's K/V
        meeting split queries, a gate or time-step projection meeting split channels). Returns the
        propagation, the column projections, their segments and the other split parameters. ``segments``: those
        learnt already (a fused projection's parts, which its chunks held by several ranks do not show).
        """
        columns = self._with_packed_siblings(group)
        upstream = Ancestors([*(self.nodes[p.input] for p in group), *reads], self.index) if grow else set()
        seed, segments = seed or {}, dict(segments or {})
        params: dict[str, Shard] = dict(seed)
        traced_here: dict = {}
        for _ in range(8):
            prop = self._propagate(_layouts(columns, segments, shared) | self._adapters_of(columns, segments, shared)
                                   | params, tp)
            learnt = segments | {origin: parts for o, hint in prop.hints.items() if self._one_weight(o)
                                 for origin in o if origin not in ups_beside(self.adapter_ups, o)
                                 and (parts := _scaled(hint, self.projections[origin]))}
            if learnt != segments:
                segments, params = learnt, dict(seed)  # parameters are re-learnt against the new segments
                continue
            grown, traced = self._feeding(prop, columns, upstream, traced_here) if grow else ([], {})
            if grown or traced.keys() - params.keys():
                columns, params = columns + grown, (dict(seed) if grown else params | traced)
                continue
            learnt_params = params | {self.nodes[c.source].target: c.steps[0].shard for c in prop.steps_of(Operator.SCATTER)
                                      if len(c.steps) == 1 and self.nodes[c.source].op == "get_attr"
                                      and self.nodes[c.source].target in self.trainable}
            if learnt_params == params:
                break
            params = learnt_params
        return prop, columns, segments, params

    def _with_packed_siblings(self, group: list[Projection]) -> list[Projection]:
        """``group`` and the projections on the other slices of its packed parameters (cross-attention's K/V beside
        its Q): a packed parameter is split as a whole or not at all."""
        packed = {p.weight for p in group if p.packed is not None}
        if not packed:
            return list(group)
        siblings = [p for p in self.projections.values() if p.weight in packed and p not in group
                    and p.node not in self.claimed]
        tiled = {w for w, ps in packed_by_weight(list(group) + siblings).items() if packed_segments(ps, {})}
        # slices that do not tile their parameter (a slice read by something else) cannot be split: left out
        return [p for p in list(group) + siblings if p.packed is None or p.weight in tiled]

    def _one_weight(self, origins: frozenset) -> bool:
        """Whether the projections a split value comes from use one weight: one projection, or the experts of
        a bank whose outputs were joined (fused gate/up columns cut after the experts' outputs are concatenated).
        An adapter added to a projection's output counts as that projection (its segments are the base's)."""
        ups = set(self.adapter_ups.values())
        return len({self.projections[o].weight for o in origins if o not in ups or len(origins) == 1}) == 1

    def _adapters_of(self, columns: list[Projection], segments: dict, shared: dict | None) -> dict[str, Shard]:
        """The layouts of the adapters' up-projections on ``columns``, split like their bases."""
        ups = up_projections(columns, self.adapter_ups, self.projections)
        return _layouts(list(ups.values()), by_up(segments, ups), by_up(shared or {}, ups)) if ups else {}

    def _propagate(self, layouts: dict[str, Shard], tp: int) -> Propagation:
        """A candidate's propagation (``auto_rows``, windowed), kept for the next few: a search often asks for the
        same layouts again (a group tried again without growing starts where it started)."""
        key = (frozenset(layouts.items()), tp)
        if key not in self.propagations:
            self._keep(key, propagate(self.graph, self.projections, self.embeddings, layouts, tp, self.trainable,
                                      auto_rows=True, grad=self.grad, index=self.index, decisions=self.decisions))
        return self.propagations[key]

    def _keep(self, key, prop: Propagation) -> None:
        self.propagations[key] = prop
        if len(self.propagations) > _KEPT:
            del self.propagations[next(iter(self.propagations))]

    def _feeding(self, prop: Propagation, columns: list[Projection], upstream: Container[str],
                 traced_here: dict) -> tuple[list[Projection], dict[str, Shard]]:
        """What made the whole values gradients flow through that split values meet (``sources.trace``):
        splitting those projections and parameters instead of slicing their outputs keeps the region closed.
        ``traced_here``: the traces found so far against ``upstream`` (one attempt's refinements slice the same
        values again)."""
        taken = {p.node for p in columns} | self.claimed
        found: dict[str, Projection] = {}
        params: dict[str, Shard] = {}
        for conv in self._sliced(prop):
            if self.nodes[conv.source].op == "get_attr":
                continue  # a parameter sliced: learnt by ``attempt`` itself
            key = (conv.source, conv.steps[-1].shard, len(columns))
            if key not in traced_here:
                traced_here[key] = trace(self.sources, self.nodes[conv.source], conv.steps[-1].shard, upstream,
                                         inputs=self._inputs(columns))
            traced = traced_here[key]
            if traced is None or taken & traced.projections.keys():
                continue
            found |= traced.projections
            params |= traced.params
        return list(found.values()), params

    def _upstream(self, columns: list[Projection]) -> Ancestors:
        """Every value the inputs of ``columns`` are computed from (the group's own input and the residual
        stream before it: what the region reads, which growing it must not split)."""
        return Ancestors([self.nodes[p.input] for p in columns], self.index)

    def _sliced(self, prop: Propagation) -> list:
        """Slices of values gradients flow through (a value no gradient reaches, a per-head table or a mask,
        is sliced for free), other than values made from the region's own rows (a time-step projection reading
        V's split features, all-reduced, then taken per head: only its small gradient is gathered), values
        repeated along the split dim (``repeated``) and values computed per head from the region's own whole input
        alone (``_per_head_of_input``)."""
        rows = set(prop.rows)
        return [c for c in prop.steps_of(Operator.SCATTER) if c.source in self.grad
                and not self._from_rows(rows, c.source, c.steps[-1].shard)
                and not repeated(self.nodes[c.source], c.steps[-1].shard, self.tp)
                and not self._per_head_of_input(prop, c.source, c.steps[-1].shard)]

    def _per_head_of_input(self, prop: Propagation, source: str, shard: Shard) -> bool:
        """Whether ``source`` is computed per head from the whole inputs of the region's columns alone, through ops
        that keep its heads apart (WavLM's gate of its relative position bias: the input taken per head, by a
        linear the heads share): every rank computes it whole and keeps its heads, its gradient (a few numbers per
        head and position) gathered."""
        columns = [self.projections[o] for o in sorted({o for origins in prop.origins.values() for o in origins})
                   if o in self.projections and o not in prop.rows]
        if not columns:
            return False
        key = (source, shard, tuple(p.node for p in columns))
        if key not in self.traced:
            self.traced[key] = trace(self.sources, self.nodes[source], shard, set(), inputs=self._inputs(columns))
        traced = self.traced[key]
        # nothing to split on the way: it reads whole values only (the region's input, values no gradient reaches)
        return traced is not None and not traced.projections and not traced.params

    def _inputs(self, columns: list[Projection]) -> set[str]:
        """The values the ``columns`` read whole (through ``f``), and those these are reshapes, transposes or casts
        of: what the region already holds whole on every rank."""
        out = set()
        for p in columns:
            node = self.nodes[p.input]
            while node.name not in out:
                out.add(node.name)
                if node.op != "call_function" or rule_for(node.target) not in (reshape, permute, like_first) \
                        or not node.args or not isinstance(node.args[0], fx.Node):
                    break
                node = node.args[0]
        return out

    def _from_rows(self, rows: set[str], source: str, shard: Shard) -> bool:
        key = (source, shard)
        if key not in self.traced:
            self.traced[key] = trace(self.sources, self.nodes[source], shard, set())
        traced = self.traced[key]
        return traced is not None and bool(traced.projections.keys() & rows)

    def closed(self, prop: Propagation, allow_slices: bool) -> bool:
        """A region: at least one row closes it, nothing had to be gathered (or sliced, unless allowed)."""
        return (bool(prop.rows) and not prop.refusals and not prop.steps_of(Operator.GATHER)
                and not self.heads & set(prop.rows) and (allow_slices or not self._sliced(prop)))

    def _shared(self, columns: list[Projection], failing: set[str], prop: Propagation,
                segments: dict[str, tuple[int, ...]]) -> RegionMatch | None:
        """The region with the ``failing`` projections (K/V whose heads tp does not divide) split into fewer chunks
        than ranks, each held by several ranks: the KV head the holders' query heads use (most chunks first)."""
        if any(p.packed is not None for p in columns if p.node in failing):
            return None  # a packed parameter's slices are split alike (one placement), never held by several ranks
        for chunks in [c for c in range(self.tp - 1, 1, -1) if self.tp % c == 0]:
            shared = {p.node: self.tp // chunks for p in columns if p.node in failing}
            sub, _, learnt, params = self.attempt(columns, self.tp, grow=False, shared=shared, segments=segments)
            if self.closed(sub, allow_slices=False) and not sub.violations and set(sub.rows) == set(prop.rows):
                return self.match(columns, sub, learnt, params, shared=shared)
        return None

    def match(self, columns: list[Projection], prop: Propagation, segments: dict, params: dict,
              replicated=(), shared: dict[str, int] | None = None) -> RegionMatch:
        sizes = tuple(s for p in columns for s in (segments.get(p.node) or (p.out_features,)))
        convolutions = any(self.projections[n].spatial for n in (*(p.node for p in columns), *prop.rows))
        kind = RegionKind.CONVOLUTION if convolutions else _classify(self.nodes, prop)
        return RegionMatch(kind=kind, columns=tuple(p.node for p in columns),
                           rows=tuple(prop.rows), segments=tuple(segments.get(p.node, ()) for p in columns),
                           replicated=tuple(replicated), params=tuple(params.items()),
                           shared=tuple((shared or {}).items()),
                           row_segments=tuple(self._row_segments(prop, row) for row in prop.rows),
                           violations=tuple(prop.violations),
                           sizes=sizes + tuple(prop.checked))

    def _row_segments(self, prop: Propagation, row: str) -> tuple[int, ...]:
        lay = prop.layouts.get(self.projections[row].input)
        return lay.segments if isinstance(lay, Shard) and len(lay.segments) > 1 else ()

    def _unblamed(self, prop: Propagation, group: list[Projection]) -> list[Projection]:
        """The members of ``group`` whose split values reach no blocking conversion and no refused op, when some
        do (a router read together with a shared expert's gate and up projections; a shortcut convolution beside
        a bottleneck's first one, whose split output a residual ``+=`` would write into)."""
        blocking = prop.steps_of(Operator.GATHER) + self._sliced(prop)
        blamed = set().union(*(prop.origins.get(c.source, frozenset()) for c in blocking),
                             *(prop.origins.get(a.name, frozenset()) for node, _ in prop.refusals
                               for a in self.nodes[node].all_input_nodes))
        rest = [p for p in group if p.node not in blamed]
        return rest if 0 < len(rest) < len(group) else []

    def why_open(self, prop: Propagation) -> str:
        """Why a propagation did not close into a region, for the plan's notes."""
        if prop.refusals:
            return prop.refusals[0][1]
        if self.heads & set(prop.rows):  # the split reached the vocabulary head: it was the residual stream
            return "its split output is the residual stream (it would reach the LM head)"
        blocked = prop.steps_of(Operator.GATHER) or self._sliced(prop)
        if not blocked:
            return "no projection downstream takes its split output as input"
        conv = blocked[0]
        consumer = self.nodes[conv.consumers[0][0]]
        return f"its split output would have to be made whole again at {getattr(consumer.target, '__name__', consumer.target)}"

    def _dead_end(self, proj: Projection) -> bool:
        """Whether ``proj`` tried alone as a column split provably closes no region, found by watching the walk
        ``attempt`` starts with (``dead_ends.DeadEndWatch``), stopped at the proof. A walk that finds none has run
        to its end: it is kept for ``attempt``, which asks for it next."""
        node = self.nodes[proj.node]
        layouts = _layouts([proj], {})
        key = (frozenset(layouts.items()), self.tp)
        if self.index.positions[node] >= self.shared_from or key in self.propagations:
            return False
        watch = DeadEndWatch(node, self.index.rank(node) + proj.out_axis, self._upstream([proj]), self.grad,
                             self.projections.keys() | self.embeddings.keys(), self.index)
        prop = propagate(self.graph, self.projections, self.embeddings, layouts, self.tp, self.trainable,
                         auto_rows=True, grad=self.grad, index=self.index, decisions=self.decisions, stop=watch)
        if watch.proof is None:
            self._keep(key, prop)
        return watch.proof is not None

    def explain(self, why: str) -> str:
        """``why`` in words: an ``Unexplained`` group's full try, against ``claimed`` as it was then."""
        if not isinstance(why, Unexplained):
            return why
        claimed, self.claimed = self.claimed, set(why.claimed)
        try:
            found = self.find([self.projections[n] for n in why.group], early=False)
        finally:
            self.claimed = claimed
        if not isinstance(found, str):
            raise RuntimeError(f"a lone column try of {why.group} judged dead early closes a region after all: "
                               "passes/dead_ends.py's proof is wrong for this graph (a bug in autotp)")
        return found

    def lone_row(self, proj: Projection, why: str) -> RegionMatch | None:
        """``proj`` row-split alone, when that needs nothing but slicing its own whole input and all-reducing
        its output (a projection into the residual stream, a pooler), or None."""
        layout = {proj.weight: Shard(proj.in_dim, per_expert(proj, (proj.in_features,)))}
        prop = self._lone_row(layout)
        sliced = [c for c in prop.steps_of(Operator.SCATTER) if c.source in self.grad]
        if (prop.refusals or prop.violations or prop.steps_of(Operator.GATHER)
                or any(c.source != proj.input or {n for n, _ in c.consumers} != {proj.node} for c in sliced)):
            return None
        params = self._table_split(sliced)
        if params:  # the input is made from a parameter alone (a position table): split it, not the input
            split = self._lone_row(layout | params)
            if not split.refusals and not split.violations and not split.steps_of(Operator.GATHER) and not [
                    c for c in split.steps_of(Operator.SCATTER) if c.source in self.grad]:
                return RegionMatch(kind=RegionKind.ROW, columns=(), rows=(proj.node,), segments=(),
                                   params=tuple(params.items()), sizes=(proj.in_features,), why=why)
        return RegionMatch(kind=RegionKind.ROW, columns=(), rows=(proj.node,), segments=(),
                           sizes=(proj.in_features,), why=why)

    def _lone_row(self, layouts: dict[str, Shard]) -> Propagation:
        return propagate(self.graph, self.projections, self.embeddings, layouts, self.tp, self.trainable,
                         grad=self.grad, index=self.index, windowed=True, decisions=self.decisions)

    def _table_split(self, sliced: list) -> dict[str, Shard]:
        """The parameters to split so that a lone row's input arrives split with no slice: where the input is
        computed from parameters alone (a learnt position table, expanded to the batch), never through a
        projection; else none."""
        if len(sliced) != 1:
            return {}
        traced = trace(self.sources, self.nodes[sliced[0].source], sliced[0].steps[-1].shard, set())
        return dict(traced.params) if traced is not None and traced.params and not traced.projections else {}

    def find(self, group: list[Projection], early: bool = True) -> RegionMatch | str:
        """The region ``group`` starts (with a fallback that keeps failing projections whole), or why none
        (``Unexplained`` when ``early`` proved a lone projection's try dead before wording why: ``explain``)."""
        if early and len(group) == 1 and self._dead_end(group[0]):
            return Unexplained(tuple(p.node for p in group), self.claimed)
        prop, columns, segments, params = self.attempt(group, self.tp)
        if not self.closed(prop, allow_slices=False) and len(columns) > len(group):
            prop, columns, segments, params = self.attempt(group, self.tp, grow=False)
        if not self.closed(prop, allow_slices=False):
            why = self.why_open(prop)
            rest = self._unblamed(prop, group)
            region = self.find(rest) if rest else why
            if not isinstance(region, str):  # the others split without the projections that blocked them
                self.set_aside.append((tuple(p.node for p in group if p not in rest), why))
            return region
        full = self.match(columns, prop, segments, params)
        if not prop.violations:
            return full
        failing = set().union(*(v.origins for v in prop.violations))
        kept = [p for p in columns if p.node not in failing]
        if (kept or _fused_alone(columns, segments)) and len(kept) < len(columns):
            shared = self._shared(columns, failing, prop, segments)
            if shared is not None:
                return shared
        if kept and len(kept) < len(columns):
            sub, _, sub_segments, sub_params = self.attempt(kept, self.tp, grow=False)
            if self.closed(sub, allow_slices=True) and not sub.violations and set(sub.rows) == set(prop.rows):
                return self.match(kept, sub, sub_segments, sub_params,
                                  replicated=[p.node for p in columns if p not in kept])
        return full


def _fused_alone(columns: list[Projection], segments: dict[str, tuple[int, ...]]) -> bool:
    """Whether ``columns`` is one projection whose output holds several parts (a fused QKV): its parts cannot be
    held apart, so where K/V's heads are fewer than the ranks the whole projection is held by several ranks per
    chunk, and each narrows its queries to its own heads where they meet the keys (``steps.narrow``)."""
    return len(columns) == 1 and len(segments.get(columns[0].node, ())) > 1


_KEPT = 16
"""Propagations a region search keeps (``RegionFinder._propagate``): those of one group's attempts."""


def _scaled(hint: tuple[int, ...], proj: Projection) -> tuple[int, ...] | None:
    """A hint's segments in the projection's output features (a hint may be in other units, such as one per
    fused part), or None when they do not scale to them."""
    factor, rest = divmod(proj.out_features, sum(hint))
    return tuple(h * factor for h in hint) if factor and not rest else None
