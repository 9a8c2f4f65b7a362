"""Low-rank adapters found in the graph: ``y = W x + s * B(A(x))`` with ``A`` narrow (LoRA, as peft builds it).

An adapter is two projections in a row, ``down`` (``A``: in -> r) then ``up`` (``B``: r -> out) with r smaller
than both sides, whose output (times whole factors: peft's ``scaling``) is added to the output of a ``base``
projection reading the same input (``down`` may read it through a dropout or a cast, as peft's ``lora_dropout``
does). Nothing here knows peft: the pattern is the arithmetic, so any hand-written LoRA matches too.

The planner splits an adapter at its base layer's communication (Megatron's layout for adapters): on a
column-split base, ``A`` whole and ``B`` split by its outputs, so the adapter's output lands where the base's does;
on a row-split base, ``A`` split by its inputs like the base and ``B`` whole, applied to the partial sum before the
base's one all-reduce (``partial``: a product by a whole weight is linear in the partial sum).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import fx

from autotp.passes.graph import meta_val
from autotp.passes.projections import Projection
from autotp.passes.propagation import Conversion
from autotp.passes.steps import COPY, GRAD_SUM, Step

aten = torch.ops.aten

_PASS_THROUGH = {aten.dropout.default, aten.native_dropout.default, aten.to.dtype, aten._to_copy.default,
                 aten.clone.default, aten.alias.default, aten.contiguous.default}
"""Ops between an adapter's input and the base layer's: peft's dropout (identity when 0), a cast to the adapter's
dtype."""

_RESHAPES = {aten.view.default, aten.reshape.default, aten._unsafe_view.default}
"""A projection computed on tokens flattened into one dim (GPT-2's ``Conv1D``: ``addmm`` of a view) reads and
writes views of the values the adapter reads and adds to."""

_SCALES = {aten.mul.Tensor, aten.div.Tensor}
_ADDS = {aten.add.Tensor, aten.add_.Tensor}


@dataclass(frozen=True)
class Adapter:
    """A low-rank product added to a base projection's output (projection node names)."""

    down: str
    """``A``: the input features to the rank."""
    up: str
    """``B``: the rank to the base's output features."""
    base: str
    """The projection whose output the adapter's is added to."""
    rank: int


def _source(node: fx.Node) -> fx.Node:
    """The value ``node`` passes on unchanged in the arithmetic that matters here (through dropout, casts and
    reshapes)."""
    while node.op == "call_function" and node.target in _PASS_THROUGH | _RESHAPES and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    return node


def _only_reader(node: fx.Node) -> fx.Node | None:
    readers = [u for u in node.users if u.target is not aten._assert_tensor_metadata.default]
    return readers[0] if len(readers) == 1 else None


def _added_to(node: fx.Node) -> fx.Node | None:
    """The other operand of the add that ``node`` reaches through scalings by a number or a whole factor, if any."""
    at = node
    while (reader := _only_reader(at)) is not None:
        scaled = reader.args[0] is at or (reader.target is aten.mul.Tensor and reader.args[1] is at)  # DoRA: v * BAx
        if reader.target in _SCALES and scaled:
            at = reader
            continue
        if reader.target in _ADDS and len(reader.args) == 2 and not reader.kwargs:
            other = reader.args[1] if reader.args[0] is at else reader.args[0]
            return other if isinstance(other, fx.Node) else None
        return None
    return None


def adapter_adds(graph: fx.Graph, adapters: dict[str, Adapter]) -> set[str]:
    """The add nodes where an adapter's (scaled) output joins its base projection's: the value after one is the
    base's output plus a low-rank term, so a choice made from where the base's output goes (a head transform kept
    whole, ``choices``) looks through it."""
    nodes = {n.name: n for n in graph.nodes}
    out = set()
    for adapter in adapters.values():
        at = nodes[adapter.up]
        while (reader := _only_reader(at)) is not None and reader.target in _SCALES:
            at = reader
        if reader is not None and reader.target in _ADDS:
            out.add(reader.name)
    return out


def adapter_reads(graph: fx.Graph, adapters: dict[str, Adapter], bases: set[str]) -> set[str]:
    """The nodes by which the adapters on ``bases`` read their layer's input: each one's ``A`` and the dropout and
    casts before it (read by it alone). A choice made from where a value goes (``vocab.feeds_only_heads``) counts
    them as the base's reading."""
    nodes = {n.name: n for n in graph.nodes}
    out = set()
    for adapter in adapters.values():
        if adapter.base not in bases:
            continue
        at = nodes[adapter.down]
        out.add(at.name)
        while isinstance(at.args[0], fx.Node) and at.args[0].target in _PASS_THROUGH and _only_reader(at.args[0]) is at:
            at = at.args[0]
            out.add(at.name)
    return out


def _added_base(node: fx.Node, by_node: dict[str, Projection]) -> fx.Node | None:
    """The base projection's output that an adapter's output is added to: the add's other operand, or the sum of
    earlier adapters added to it (several adapters on one layer add one after the other)."""
    other = _added_to(node)
    while other is not None and other.target in _RESHAPES and other.args[0].name in by_node:
        other = other.args[0]
    while other is not None and other.name not in by_node:
        scaled = [a for a in other.args if isinstance(a, fx.Node) and a.name in by_node] \
            if other.target is aten.mul.Tensor else []
        if len(scaled) == 1:  # DoRA's ``(m / ||W + sBA|| - 1) * W x`` beside its adapter's term
            return scaled[0]
        if other.target not in _ADDS or len(other.args) != 2:
            return None
        other = other.args[0] if isinstance(other.args[0], fx.Node) else None
    return other


def find_adapters(graph: fx.Graph, projections: dict[str, Projection]) -> dict[str, Adapter]:
    """Every low-rank adapter in ``graph``, keyed by its ``up`` projection's node (module docstring)."""
    nodes = {n.name: n for n in graph.nodes}
    found: dict[str, Adapter] = {}
    for up in projections.values():
        if up.experts > 1 or up.packed is not None or up.spatial:
            continue
        down_node = _source(nodes[up.input])
        down = projections.get(down_node.name)
        if down is None or down.bias is not None or up.bias is not None or _only_reader(down_node) is None:
            continue
        rank = down.out_features
        base_node = _added_base(nodes[up.node], projections)
        base = projections.get(base_node.name) if base_node is not None else None
        if base is None or base.node in (down.node, up.node) or up.in_features != rank:
            continue
        same_input = _source(nodes[down.input]) is _source(nodes[base.input])
        low = rank < min(base.in_features, base.out_features)
        shaped = down.in_features == base.in_features and up.out_features == base.out_features
        if same_input and low and shaped and meta_val(nodes[up.node]).dtype.is_floating_point:
            found[up.node] = Adapter(down.node, up.node, base.node, rank)
    return found


def copy_before_down(prop, nodes: dict[str, fx.Node], adapters: dict[str, Adapter], projections: dict[str, Projection],
                     grad: set[str]) -> None:
    """On a column-split base, read the adapter's input through the base's ``f`` instead of its rank-r value.

    The propagation reads a column-split ``B``'s whole input ``h = A x`` through ``f`` (an all-reduce of the
    gradient of ``h``, per adapter). The gradient of ``h`` is linear in the ranks' shares, so the sum may run after
    ``A`` instead: ``A x`` then reads ``x`` through ``f`` (the base's own: one all-reduce serves both) and ``A``'s
    weight gradient, each rank's share (r x in, not batch x seq x r), is summed in the end-of-backward bucket with
    every other adapter's (``weight_sum``)."""
    for adapter in adapters.values():
        up, down = projections[adapter.up], projections[adapter.down]
        key = next((k for k, c in prop.conversions.items() if c.steps == (COPY,) and (up.node, (0,)) in c.consumers
                    and c.source == down.node), None)
        weight = nodes[down.node].args[1]
        edges = {c for conv in prop.conversions.values() for c in conv.consumers}
        if key is None or prop.layouts.get(down.input) is not None or (down.node, (0,)) in edges \
                or (down.node, (1,)) in edges or down.node in prop.reduced:
            continue
        conv = prop.conversions[key]
        conv.consumers.remove((up.node, (0,)))
        if not conv.consumers:
            del prop.conversions[key]
        value, edge = _earliest_read(nodes, down.node, edges)
        _read_through(prop, value, edge)
        _base_copy_to(prop, nodes, adapter.base, value)
        if weight.name in grad:  # a frozen A has no gradient to sum
            _read_through(prop, weight.name, (down.node, (1,)), weight_sum(weight))


def _earliest_read(nodes: dict[str, fx.Node], reader: str, edges: set) -> tuple[str, tuple]:
    """The value to read through ``f`` for ``reader``'s input, and the edge reading it: back through the dropout and
    casts that only ``reader`` reads (each linear in its input, with a mask the same on every rank), so that the
    base's ``f`` of the layer's input serves the adapter too."""
    at = nodes[reader]
    value = at.args[0]
    while value.op == "call_function" and value.target in (_PASS_THROUGH - {aten.native_dropout.default}) \
            and _only_reader(value) is at and isinstance(value.args[0], fx.Node) and (value.name, (0,)) not in edges:
        at, value = value, value.args[0]
    return value.name, (at.name, (0,))


def _base_copy_to(prop, nodes: dict[str, fx.Node], base: str, value: str) -> None:
    """Move the base projection's ``f`` onto ``value`` where it reads a reshape of it (GPT-2's ``Conv1D`` flattens
    the tokens first): the gradient of a reshape is the same on every rank, so one ``f`` of ``value`` serves the base
    and its adapter."""
    for key, conv in list(prop.conversions.items()):
        if conv.steps != (COPY,) or len(conv.consumers) != 1 or conv.consumers[0][0] != base:
            continue
        at = nodes[conv.source]
        first = None
        while at.op == "call_function" and at.target in _RESHAPES and _only_reader(at) is not None:
            first, at = at, at.args[0]
        if first is None or at.name != value:
            return
        del prop.conversions[key]
        _read_through(prop, value, (first.name, (0,)))
        return


def _read_through(prop, value: str, edge: tuple, step: Step = COPY) -> None:
    prop.conversions.setdefault((value, (step,)), Conversion(value, (step,))).consumers.append(edge)


def weight_sum(weight: fx.Node) -> Step:
    """How an adapter's whole weight is read when each rank computes a share of its gradient: a parameter read as
    it is (``get_attr``) goes into the end-of-backward bucket (``GRAD_SUM``: one all-reduce for all adapters, not
    one each); any other value (a cast of it) through ``f``, whose backward sums the share where it arrives."""
    return GRAD_SUM if weight.op == "get_attr" else COPY


def up_projections(columns: list[Projection], ups: dict[str, str], projections: dict[str, Projection]) -> dict:
    """The up-projections (``ups``: by base node) of the adapters on ``columns``, by base node: a region's trial
    splits them with their bases (their outputs are added to the bases')."""
    return {c.node: projections[ups[c.node]] for c in columns if c.node in ups and c.packed is None}


def by_up(by_base: dict, ups: dict[str, Projection]) -> dict:
    """Values keyed by base node (a column's segments, its chunks' holders) keyed by its adapter's up-projection."""
    return {u.node: by_base[b] for b, u in ups.items() if by_base.get(b)}


def ups_beside(ups: dict[str, str], origins: frozenset) -> set[str]:
    """The adapters' up-projections among the ``origins`` of a split value that has a base among them too (the
    base, not its adapter, learns the segments both are cut in)."""
    found = set(ups.values()) & origins
    return found if len(origins) > len(found) else set()
