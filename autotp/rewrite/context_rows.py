"""Each rank builds only its own rows of what the model computes whole over the sequence (the ``[B, 1, T, T]``
mask above all): a read of a whole value at the rank's positions (``index_select(value, dim, positions)``, which
``rewrite.context_graph`` inserts) is moved up through the ops that built the value, position by position, to
the sequence-long leaves (an ``arange``, a model input, a cumulative sum), so the rank computes ``T/cp`` rows of
the mask instead of ``T`` and reads them, rather than building it whole and keeping a ``1/cp`` slice.

Moving the read is exact: each op it passes computes every row from the same rows of its inputs (elementwise
ops with broadcasting, ``expand``, ``unsqueeze``, full slices, advanced indexing by sequence-long index tensors);
at anything else (a ``cumsum`` along the sequence, a parameter) the read stays where it is.
"""

from __future__ import annotations

import sympy
import torch
from torch import fx

from autotp.passes.graph import SHAPE_META, meta_val
from autotp.passes.rule_kit import norm_dim
from autotp.passes.sequence_split import _ELEMENTWISE
from autotp.torch_private import is_op_overload

aten = torch.ops.aten
_LOGICAL = {aten.__and__.Tensor, aten.__or__.Tensor, aten.__xor__.Tensor}
_FULL_END = 2 ** 62


def _sizes(node) -> tuple | None:
    recorded = node.meta.get(SHAPE_META) if isinstance(node, fx.Node) else None
    if recorded is not None:
        return tuple(recorded)
    val = meta_val(node)
    return tuple(val.shape) if isinstance(val, torch.Tensor) else None


def _whole(size, seq) -> bool:
    return not isinstance(size, int) and sympy.sympify(size) == seq


class _Rows:
    """One graph's reads moved up (``push_rows``)."""

    def __init__(self, graph: fx.Graph, seq, positions: fx.Node, local_length: fx.Node):
        self.graph, self.seq, self.positions, self.local = graph, seq, positions, local_length
        self.made: dict[tuple[str, int], fx.Node] = {}
        self.moved = 0

    def rows(self, node: fx.Node, dim: int) -> fx.Node:
        """A node computing ``node``'s rows at the positions along ``dim`` (inserted at the graph's cursor)."""
        key = (node.name, dim)
        if key not in self.made:
            self.made[key] = self._rows(node, dim)
        return self.made[key]

    def _rows(self, node: fx.Node, dim: int) -> fx.Node:
        sizes = _sizes(node)
        target = node.target if node.op == "call_function" else None
        if sizes is None or dim >= len(sizes) or not _whole(sizes[dim], self.seq):
            return node  # broadcast along dim (size 1): the same for every row
        rule = self._rule(target)
        if rule is not None:
            made = rule(node, dim, sizes)
            if made is not None:
                self.moved += 1
                return made
        return self.graph.call_function(aten.index_select.default, (node, dim, self.positions))

    def _rule(self, target):
        if target in _LOGICAL or target in _ELEMENTWISE - {aten.layer_norm.default, aten.rms_norm.default} or (
                is_op_overload(target) and torch.Tag.pointwise in target.tags):
            return self._pointwise
        return {aten.unsqueeze.default: self._unsqueeze, aten.slice.Tensor: self._slice,
                aten.expand.default: self._expand, aten.index.Tensor: self._index}.get(target)

    def _copy(self, node: fx.Node, args, kwargs=None) -> fx.Node:
        return self.graph.call_function(node.target, tuple(args), dict(node.kwargs if kwargs is None else kwargs))

    def _pointwise(self, node, dim, sizes):
        def arg(a):
            if not isinstance(a, fx.Node) or _sizes(a) is None:
                return a
            at = dim - (len(sizes) - len(_sizes(a)))
            return self.rows(a, at) if at >= 0 else a
        return self._copy(node, [arg(a) for a in node.args], {k: arg(v) for k, v in node.kwargs.items()})

    def _unsqueeze(self, node, dim, sizes):
        at = norm_dim(node.args[1], len(sizes))
        return self._copy(node, [self.rows(node.args[0], dim - 1 if at < dim else dim), *node.args[1:]])

    def _slice(self, node, dim, sizes):
        x = node.args[0]
        d = norm_dim(node.args[1] if len(node.args) > 1 else 0, len(sizes))
        start, end = (node.args[2] if len(node.args) > 2 else None), (node.args[3] if len(node.args) > 3 else None)
        step = node.args[4] if len(node.args) > 4 else 1
        if d == dim and not (start in (None, 0) and isinstance(end, int) and end >= _FULL_END and step == 1):
            return None
        return self._copy(node, [self.rows(x, dim), *node.args[1:]])

    def _expand(self, node, dim, sizes):
        x, shape = node.args[0], list(node.args[1])
        at = dim - (len(shape) - len(_sizes(x)))
        source = self.rows(x, at) if at >= 0 else x
        if shape[dim] != -1:
            shape[dim] = self.local
        return self._copy(node, [source, shape, *node.args[2:]])

    def _index(self, node, dim, sizes):
        """``x[i0, i1, ...]`` (index tensors on the leading dims): the result's leading dims are the indices'
        broadcast, so its rows are the indices' rows."""
        x, indices = node.args[0], node.args[1]
        shapes = [_sizes(i) for i in indices if i is not None]
        if any(i is None for i in indices) or not shapes:
            return None
        rank = max(len(s) for s in shapes)
        if dim >= rank:
            return None
        return self._copy(node, [x, [self.rows(i, dim - (rank - len(_sizes(i))))
                                     if dim - (rank - len(_sizes(i))) >= 0 else i for i in indices]])


def push_rows(gm: fx.GraphModule, seq, positions: fx.Node, local_length: fx.Node) -> int:
    """Move every read of a whole computed value at ``positions`` in ``gm`` up to the leaves it is built from
    (module docstring); ``seq``: the sequence length's symbol. Returns how many ops now compute rows only."""
    graph = gm.graph
    reads = [n for n in graph.nodes if n.target is aten.index_select.default and n.args[2] is positions
             and isinstance(n.args[0], fx.Node) and n.args[0].op == "call_function"]
    moved = 0
    for read in reads:
        rows = _Rows(graph, seq, positions, local_length)
        with graph.inserting_before(read):
            made = rows.rows(read.args[0], norm_dim(read.args[1], len(_sizes(read.args[0]))))
        if rows.moved:
            read.replace_all_uses_with(made)
            moved += rows.moved
    for node in reversed(list(graph.nodes)):  # the whole values only the reads read, and unused copies
        if node.op == "call_function" and not node.users and _pure(node):
            graph.erase_node(node)
    graph.lint()
    gm.recompile()
    return moved


def _pure(node: fx.Node) -> bool:
    """Ops without effects that a moved read may leave unread: those it moves through, the reads, ``arange``."""
    return node.target in _LOGICAL or node.target in _ELEMENTWISE or node.target in (
        aten.unsqueeze.default, aten.slice.Tensor, aten.expand.default, aten.index.Tensor, aten.index_select.default,
        aten.arange.default, aten.new_ones.default) or (is_op_overload(node.target)
                                                       and torch.Tag.pointwise in node.target.tags)
