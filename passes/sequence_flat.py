"""Sequence parallelism for projections computed on tokens flattened into one dim (GPT-2's ``Conv1D``).

Such a layer views its ``[B, T, C]`` input as ``[B*T, C]``, multiplies (``addmm``), and views the result back to
``[B, T, C']``. The flattened dim has no size equal to the sequence's, so the plain rules would all-reduce a row
layer's output there and slice it per rank after, and would gather a column layer's input whole and read the
flattened copy through ``f``: an all-reduce each way where Megatron's sequence parallelism has an all-gather in and
a reduce-scatter out. Both collectives are linear in the values they carry, so they can run where the sequence is a
dim of its own instead:

- out of a region: a row layer's per-rank output is a partial sum; reshapes of it are partial sums too, so the
  reduction runs after the reshape that brings the sequence dim back, as a reduce-scatter along it. The layer's bias
  is added by one rank only (``ONCE``), so the sum over the ranks holds it once; its gradient is whole on every rank.
- into a region: a column layer reading a flattened copy of the gathered input through ``f`` reads it through the
  gather's own ``f`` instead (a gather followed by ``f``: Megatron's all-gather whose backward reduce-scatters).

Exact for any reshape: the collectives only move, so this does not depend on how the tokens were flattened.
"""

from __future__ import annotations

import sympy
import torch
from torch import fx

from autotp.passes.graph import get_arg, meta_val, sizes
from autotp.passes.partial import bias_path
from autotp.passes.propagation import Conversion
from autotp.passes.steps import COPY, ONCE, Operator

aten = torch.ops.aten

_RESHAPES = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.flatten.using_ints,
             aten.unflatten.int}
_MOVES = _RESHAPES | {aten.slice.Tensor, aten.clone.default, aten.contiguous.default, aten.alias.default}
"""Ops that only move their one input's elements: ``f`` (identity forward) may read before or after them."""
_MAX_MOVES = 4
"""Moves followed from a flattened layer's output to the value with a sequence dim (a ``Conv1D`` needs one), and
from a value read through ``f`` up to the gather it was made whole by (GPT-2's head: a view and two slices)."""


def _readers(node: fx.Node) -> list[fx.Node]:
    """The users of ``node`` that read its values (not a check of its dtype and shape)."""
    return [u for u in node.users if u.target is not aten._assert_tensor_metadata.default]


def _has_sequence(node: fx.Node, sequence: frozenset) -> bool:
    return any(sympy.sympify(size) in sequence for size in sizes(node))


def _bias_added(node: fx.Node, at: fx.Node, whole) -> tuple | None:
    """The path of the whole addend when ``node`` adds one (``whole(addend)``) to ``at``, else None."""
    if node.target is not aten.add.Tensor or len(node.args) != 2 or node.kwargs:
        return None
    other = 1 if node.args[0] is at else 0 if node.args[1] is at else None
    addend = node.args[other] if other is not None else None
    return (other,) if isinstance(addend, fx.Node) and addend is not at and whole(addend) else None


def unflattened(node: fx.Node, sequence: frozenset, whole) -> tuple[fx.Node, list[tuple]] | None:
    """The reshape of ``node``'s output (through reshapes and adds of a whole value, a bias, each read once) that
    first has a dim sized like the sequence, where a row layer computed on flattened tokens can reduce-scatter,
    with the (add, path) edges of the whole addends on the way (each added by one rank, to the partial sum); None
    when there is none. ``whole(node)``: whether a value is a whole parameter."""
    at, added = node, []
    for _ in range(_MAX_MOVES):
        readers = _readers(at)
        if len(readers) != 1 or readers[0].op != "call_function":
            return None
        reader = readers[0]
        bias = _bias_added(reader, at, whole)
        if bias is not None:
            added.append((reader.name, bias))
        elif reader.target not in _RESHAPES or reader.args[0] is not at:
            return None
        elif _has_sequence(reader, sequence):
            return reader, added
        at = reader
    return None


def reduce_when_unflattened(prop, node: fx.Node, flat: fx.Node, added: list[tuple]) -> None:
    """Record in ``prop`` that row layer ``node``'s reduction runs at ``flat`` (``unflattened``), and that its own
    bias (``addmm``'s or ``linear``'s) and the whole addends ``added`` on the way are added by one rank only."""
    bias = bias_path(node)
    for at, path in ([(node.name, bias)] if bias is not None else []) + added:
        reader = node if at == node.name else next(u for u in _chain(node, flat) if u.name == at)
        source = get_arg(reader, path)
        prop.conversions.setdefault((source.name, (ONCE,)), Conversion(source.name, (ONCE,))).consumers.append(
            (at, path))
    for name in [node.name] + [at for at, _ in added]:
        prop.deferred[name] = flat.name


def _chain(node: fx.Node, end: fx.Node) -> list[fx.Node]:
    """The single readers from ``node`` to ``end``."""
    out, at = [], node
    while at is not end:
        at = _readers(at)[0]
        out.append(at)
    return out


def _conversion_into(prop, edge: tuple) -> tuple | None:
    return next((k for k, c in prop.conversions.items() if edge in c.consumers), None)


def _edges_reading(node: fx.Node) -> set[tuple]:
    """Every (reader, argument path) edge by which a node reads ``node``; a read inside a list or a keyword
    argument counts as an edge no conversion names, so that a set of conversion consumers never equals it."""
    edges = set()
    for u in _readers(node):
        for i, a in enumerate(u.args):
            if a is node:
                edges.add((u.name, (i,)))
            elif isinstance(a, (list, tuple)) and any(x is node for x in a):
                edges.add((u.name, "inside a list"))
        if any(v is node for v in u.kwargs.values()):
            edges.add((u.name, "by keyword"))
    return edges


def _moved_from(node: fx.Node, edges: set[tuple]) -> fx.Node | None:
    """``node`` when it only moves the elements of its one input (a reshape, a slice, a copy) and ``edges`` are all
    its reads; else None."""
    if node.op != "call_function" or node.target not in _MOVES or _edges_reading(node) != edges:
        return None
    others = [a for a in [*node.args[1:], *node.kwargs.values()] if isinstance(meta_val(a), torch.Tensor)]
    return None if others else node


def gather_into_flat_regions(prop, nodes: dict[str, fx.Node]) -> None:
    """Where a value split along the sequence is gathered whole, moved (flattened, sliced) and read through ``f``
    only, read it through one gather-then-``f`` on the split value (module docstring): the ``f`` moves up to the
    gather, which then reduce-scatters the gradient backward instead of all-reducing it and slicing. (The gradient
    of a move is linear and the same on every rank, so summing before or after it is the same.)"""
    for key, conv in list(prop.conversions.items()):
        if conv.steps != (COPY,):
            continue
        at, edges = nodes[conv.source], set(conv.consumers)
        into = None
        for _ in range(_MAX_MOVES):
            if _moved_from(at, edges) is None:
                break
            into = _conversion_into(prop, (at.name, (0,)))
            if into is not None:
                break
            at, edges = at.args[0], {(at.name, (0,))}
        if into is None:
            continue
        gathered = prop.conversions[into]
        if len(gathered.steps) != 1 or gathered.steps[0].operator is not Operator.GATHER:
            continue
        gathered.consumers.remove((at.name, (0,)))
        if not gathered.consumers:
            del prop.conversions[into]
        del prop.conversions[key]
        steps = (gathered.steps[0], COPY)
        prop.conversions.setdefault((gathered.source, steps), Conversion(gathered.source, steps)).consumers.append(
            (at.name, (0,)))
