"""Where a wanted split can come from: a whole value that meets a split one, traced back to what made it.

When a split value meets a whole one that gradients flow through, propagation slices the whole one,
which needs an all-gather of its gradient and keeps a region open. Often the whole value is made by
a projection, an embedding table or parameters that could be split instead (cross-attention's K/V, a
time-step projection and a per-channel decay in a state-space mixer, a per-head bias table): this
module walks back from the value through the ops that would carry such a split unchanged in meaning
(reshapes, transposes, casts, pointwise ops) and names those sources, with the split each needs.
"""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Container
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from autotp.passes.graph import arg_or_default, meta_val, rank, sizes
from autotp.passes.placement import Shard
from autotp.passes.projections import Embedding, Projection, segment_of
from autotp.passes.reshapes import broadcast_dim, map_reshape
from autotp.passes.rule_kit import like_first, norm_dim, pointwise
from autotp.passes.rules_channels import spatial_dims, spatial_op
from autotp.passes.rules import rule_for
from autotp.passes.rules_compute import along_dim, batched_matmul, layer_norm, reduction, shared_linear
from autotp.passes.rules_shape import (
    cat,
    expand,
    getitem,
    gather,
    gathers_within,
    index,
    index_select,
    new_filled,
    permutation,
    permute,
    repeat,
    repeat_blocks,
    reshape,
    select,
    slice_,
    split,
)
from torch import fx

if TYPE_CHECKING:
    from autotp.passes.graph_index import GraphIndex

_MAX_DEPTH = 16
aten = torch.ops.aten


@dataclass
class Sources:
    """What to split so that a value arrives split: column projections and parameters (target -> split)."""

    projections: dict[str, Projection] = field(default_factory=dict)
    params: dict[str, Shard] = field(default_factory=dict)


@dataclass(frozen=True)
class SourceGraph:
    """The facts tracing needs about one graph."""

    projections: dict[str, Projection]
    embeddings: dict[str, Embedding]
    grad: set[str]
    trainable: set[str]
    tp: int


def _input_shard(node: fx.Node, source: fx.Node, shard: Shard, tp: int) -> Shard | None | bool:
    """The split ``source`` needs for ``node`` to come out split as ``shard``; True: it is broadcast along that
    dim (it need not be split); None: no split of it gives that."""
    rule = rule_for(node.target)
    if rule is like_first:
        return shard
    if rule is pointwise:
        d = broadcast_dim(rank(node), rank(source), shard.dim)
        return True if d < 0 or sizes(source)[d] == 1 else shard.moved(d)
    if rule is permute:
        return shard.moved(permutation(node)[shard.dim])
    if rule is reshape:
        return map_reshape(sizes(node), sizes(source), shard, tp)
    if rule is expand:  # a per-head table expanded over batch and sequence
        d = shard.dim - (rank(node) - rank(source))
        return shard.moved(d) if d >= 0 and sizes(source)[d] != 1 else None
    if rule is index:  # ``table[ids]``: the split dim comes after the index's dims
        ids = node.args[1][0] if len(node.args[1]) == 1 else None
        return shard.moved(shard.dim + 1 - rank(ids)) if source is node.args[0] and isinstance(ids, fx.Node) \
            and shard.dim >= rank(ids) else None
    if rule is slice_:  # a slice along another dim keeps the split where it is
        return shard if arg_or_default(node, 1, "dim", 0) % rank(source) != shard.dim else None
    if rule is index_select:  # positions picked along another dim: the split dim stays
        return shard if source is node.args[0] and node.args[1] % rank(source) != shard.dim else None
    if rule is gather:  # a per-bucket table picked per position: the split dim stays
        return shard if source is node.args[0] and gathers_within(node, shard) else None
    if rule is new_filled:  # a tensor made like the value heads, then filled: made split like them
        return shard if source is node.args[0] and len(node.args[1]) == rank(source) else None
    if rule is select:  # the selected dim is gone from the output
        return shard.moved(shard.dim + (node.args[1] % rank(source) <= shard.dim))
    if rule is getitem and rule_for(source.target) is split:  # one part of a split: its input split (below)
        return _split_input(node, source, shard)
    if rule is split:  # the split's input, whose split ``_split_input`` already found
        return shard
    if rule is repeat:  # a per-head table repeated over the batch: the split of one copy
        return _repeated_input(node, source, shard)
    if rule is batched_matmul:  # scores or outputs per head (another layer's, meeting a shared per-head bias)
        return _batched_input(node, source, shard)
    if rule in (reduction, along_dim, layer_norm):  # a per-head norm: its statistic is over another dim
        return _normalised_input(node, source, shard)
    if rule is shared_linear:  # rows projected by a whole weight (heads sharing one): the input split alike
        return shard if source is node.args[0] and shard.dim < rank(node) - 1 else True
    if rule is cat:  # parts joined along the split dim (a bias of q, k and v biases): each part's own segments
        return _joined_input(node, source, shard)
    if rule is spatial_op:  # a per-head table resized over its positions (BEiT's bias, to the image's grid)
        return shard if source is node.args[0] and shard.dim < rank(source) - spatial_dims(node) else None
    return None


def _joined_input(node: fx.Node, source: fx.Node, shard: Shard) -> Shard | None:
    """The split ``source`` needs for ``cat`` to come out split as ``shard``: along another dim the same, along the
    cat dim the segments inside its part (None when a part's bounds cut a segment)."""
    parts = node.args[0]
    dim = arg_or_default(node, 1, "dim", 0) % rank(node)
    if dim != shard.dim:
        return shard if rank(source) == rank(node) else None
    if shard.blocks != 1 or shard.replicas != 1 or parts.count(source) != 1:
        return None
    if rank(source) != rank(node):
        return None
    # an empty 1-D part (torch.cat skips it, as PI0's prefix) adds nothing along the dim
    start = sum(sizes(p)[dim] for p in parts[:parts.index(source)] if rank(p) == rank(node))
    return segment_of(shard, (start, sizes(source)[dim], shard.size))


def _batched_input(node: fx.Node, source: fx.Node, shard: Shard) -> Shard | bool | None:
    """The split ``source`` needs for a batched matmul to come out split as ``shard`` along a batch dim (the
    heads): the same batch dim of each operand, aligned from the right as broadcasting aligns them (True where
    the operand broadcasts along it); None for a split of the matrix dims."""
    if shard.dim >= rank(node) - 2 or shard.blocks != 1 or shard.replicas != 1:
        return None
    d = broadcast_dim(rank(node), rank(source), shard.dim)
    return True if d < 0 or sizes(source)[d] == 1 else shard.moved(d)


def _split_input(node: fx.Node, parts: fx.Node, shard: Shard) -> Shard | None:
    """The split the input of ``parts`` (a split, a chunk) needs for its part ``node`` to come out split as
    ``shard``: the same, when it cuts along another dim; when it cuts along the split dim, each part one segment
    (K and V of a fused projection cut with ``chunk``: each split by its heads)."""
    x = parts.args[0]
    dim = norm_dim(arg_or_default(parts, 1 if parts.target is aten.unbind.int else 2, "dim", 0), rank(x))
    if parts.target is aten.unbind.int:
        return shard.moved(shard.dim + (dim <= shard.dim))
    if dim != shard.dim:
        return shard
    sizes_ = tuple(int(p.shape[dim]) for p in meta_val(parts))
    if shard.segments != (sizes_[node.args[1]],) or shard.blocks != 1 or shard.replicas != 1:
        return None
    return Shard(dim, sizes_)


def _repeated_input(node: fx.Node, source: fx.Node, shard: Shard) -> Shard | None:
    """The split ``source`` needs for ``repeat`` to come out split as ``shard``: the same along a dim repeated
    once, or one copy's split where the copies are ``shard``'s blocks."""
    dim = shard.dim - (len(node.args[1]) - rank(source))
    if dim < 0 or shard.replicas != 1 or shard.spread:
        return None
    repeats = node.args[1][shard.dim]
    if isinstance(repeats, int) and repeats == 1:
        return shard.moved(dim)
    one = shard.segments[:len(shard.segments) // repeats] if isinstance(repeats, int) else ()
    if shard.blocks == 1 and one and one * repeats == shard.segments:  # the copies written as segments: one copy's
        return Shard(dim, one)
    plain = dataclasses.replace(shard, dim=dim, blocks=1)
    return plain if repeat_blocks(node, plain) == shard.blocks else None


def _normalised_input(node: fx.Node, source: fx.Node, shard: Shard) -> Shard | bool | None:
    """The split ``source`` needs for a reduction, a softmax or a layer norm to come out split as ``shard``:
    the same split when the op works along other dims (a QK norm over the head dim, its heads split); True for
    a layer norm's weight and bias, which broadcast along the split dim."""
    x = node.args[0]
    if source is not x:
        return True if rule_for(node.target) is layer_norm and rank(source) < rank(node) - shard.dim else None
    if rule_for(node.target) is layer_norm:
        return shard if shard.dim < rank(x) - len(node.args[1]) else None
    if rule_for(node.target) is along_dim:
        return shard if norm_dim(arg_or_default(node, 1, "dim", 0), rank(x)) != shard.dim else None
    dims = arg_or_default(node, 1, "dim", None)
    if dims in (None, []) or isinstance(meta_val(node), (tuple, list)):
        return None
    dims = sorted(norm_dim(d, rank(x)) for d in ([dims] if isinstance(dims, int) else dims))
    if not arg_or_default(node, 2, "keepdim", False):  # the reduced dims are gone from the output: put them back
        position = shard.dim
        for d in dims:
            position += d <= position
        return shard.moved(position) if position not in dims else None
    return shard if shard.dim not in dims else None


def trace(g: SourceGraph, node: fx.Node, shard: Shard, upstream: Container[str], depth: int = 0,
          inputs: Container[str] = ()) -> Sources | None:
    """What to split for ``node`` to come out split as ``shard``, or None when something on the way cannot.

    ``upstream`` are the values the region itself reads (the residual stream before it): splitting one of
    them would change the region's own input, so a trace reaching one fails. ``inputs`` are values the region
    reads whole (its columns' inputs): a trace reaching one reads it whole (a per-head gate computed from the
    input by a linear the heads share, which each rank computes whole and slices to its heads). A projection's output wanted split along a batch dim (the heads) is its input split alike, its weight
    whole."""
    if node.name not in g.grad:
        return Sources()  # no gradient reaches it: slicing it is free
    if node.op == "get_attr":
        # before the upstream test: a parameter an earlier block also reads (a looped block's per-channel scale) is
        # upstream through that use, yet splitting it changes no value by itself; the propagation from the split
        # parameter judges the earlier use, as it judges every other
        return Sources(params={node.target: shard}) if node.target in g.trainable else None
    if node.name in inputs:
        return Sources()  # read whole, as the region already holds it
    if node.name in upstream:
        return None
    proj = g.projections.get(node.name)
    if proj is not None and shard.dim == rank(node) + proj.out_axis:
        return Sources(projections={node.name: proj})
    if proj is not None and rule_for(node.target) is not shared_linear:
        return None
    emb = g.embeddings.get(node.name)
    if emb is not None:
        return Sources(params={emb.weight: Shard(1, shard.segments)}) if shard.dim == rank(node) - 1 else None
    if depth >= _MAX_DEPTH or node.op != "call_function":
        return None
    found = Sources()
    for source in node.all_input_nodes:
        if source.name not in g.grad:
            continue
        wanted = _input_shard(node, source, shard, g.tp)
        if wanted is True:
            continue
        inner = trace(g, source, wanted, upstream, depth + 1, inputs) if wanted is not None else None
        if inner is None:
            return None
        found.projections |= inner.projections
        found.params |= inner.params
    return found


class Ancestors:
    """The names of ``nodes`` and of every value they are computed from, found as far back as asked: a trace asks
    about values near the splits it follows, so walking back through the whole graph before them for every
    candidate (a cost that grew with depth squared) is not needed. Any path to ``nodes`` from a value runs through
    later values only, so walking back in decreasing graph position down to the asked value's answers it."""

    def __init__(self, nodes: list[fx.Node], index: GraphIndex):
        self.index = index
        self.found: set[str] = set()
        self.frontier = [(-index.positions[n], n.name, n) for n in dict.fromkeys(nodes)]
        heapq.heapify(self.frontier)

    def __contains__(self, name: str) -> bool:
        floor = self.index.positions[self.index.nodes[name]]
        while self.frontier and -self.frontier[0][0] >= floor:
            _, seen, node = heapq.heappop(self.frontier)
            if seen not in self.found:
                self.found.add(seen)
                for a in node.all_input_nodes:
                    if a.name not in self.found:
                        heapq.heappush(self.frontier, (-self.index.positions[a], a.name, a))
        return name in self.found


def repeated(node: fx.Node, shard: Shard, tp: int) -> bool:
    """Whether ``node`` is one value expanded along ``shard``'s dim (a single K/V head repeated to every query
    head: ``kv[:, :, None].expand(...).reshape(b, heads, s, d)``), through reshapes, transposes and casts: each
    rank's slice is that same value, so slicing it is what replicating K/V (Megatron's multi-query attention)
    does, its gradient summed over every head."""
    for _ in range(_MAX_REPEAT_DEPTH):
        if node.op != "call_function" or not node.args or not isinstance(node.args[0], fx.Node):
            return False
        rule, source = rule_for(node.target), node.args[0]
        if rule is expand:
            d = shard.dim - (rank(node) - rank(source))
            return d < 0 or sizes(source)[d] == 1
        if rule is reshape:
            shard = map_reshape(sizes(node), sizes(source), shard, tp)
        elif rule is permute:
            shard = shard.moved(permutation(node)[shard.dim])
        elif rule is not like_first:
            return False
        if shard is None:
            return False
        node = source
    return False


_MAX_REPEAT_DEPTH = 6
"""How many reshapes, transposes and casts may lie between a repeated value and its expand."""
