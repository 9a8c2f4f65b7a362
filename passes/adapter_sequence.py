"""Low-rank adapters under sequence parallelism, at the base layer's communication (all-gather in, reduce-scatter out).

The propagation walks an adapter as any other pair of projections: on a column-split base, ``A`` (whole) reads the
layer's input as it is, split along the sequence, and its rank-r output is gathered whole for ``B`` (one more
all-gather per adapter, and ``A``'s weight read through ``f``: each rank sees only its tokens); on a row-split base,
``A_j x_j`` is reduce-scattered on its own before ``B`` (one more reduce-scatter per adapter). This pass, run on the
propagation's result, moves both onto the base's collectives:

- column-split base: ``A`` reads the base's gathered input (the base's all-gather serves both; backward, the
  gradient of that input is the base's share plus the adapter's, reduce-scattered once); ``A``'s weight gradient,
  each rank's share over all tokens, joins the end-of-backward bucket (``GRAD_SUM``);
- row-split base: ``A_j x_j`` stays this rank's partial sum over all tokens, ``B`` (whole, linear) and peft's
  scaling keep it partial, and the add of the base's partial output and the adapter's is reduce-scattered once (a
  bias of the base added by one rank, ``ONCE``); ``B``'s weight gradient, a share, joins the bucket.

A base computed on tokens flattened to ``[B*T, C]`` (GPT-2's ``Conv1D``, ``passes.sequence_flat``) is gathered before
its flattening reshape and reduce-scatters after the reshape back: the adapter (on ``[B, T, C]``) reads that gathered
input, and its partial sum joins that reduce-scatter. Adapters in any other shape (a dropout between the layer's
input and ``A``; a scaling by a trained tensor) keep the propagation's layout: exact, at more collectives.
"""

from __future__ import annotations

import torch
from torch import fx

from autotp.passes.adapters import _PASS_THROUGH, _RESHAPES, Adapter, find_adapters, weight_sum
from autotp.passes.partial import bias_path
from autotp.passes.projections import Projection
from autotp.passes.propagation import Conversion
from autotp.passes.steps import GRAD_SUM, ONCE, Operator, Step

aten = torch.ops.aten

_SCALES = {aten.mul.Tensor, aten.div.Tensor}


def _conversion_into(prop, edge: tuple) -> tuple | None:
    """The key of the conversion ``edge`` (node, argument path) reads through, if any."""
    return next((k for k, c in prop.conversions.items() if edge in c.consumers), None)


def _drop_consumer(prop, key: tuple, edge: tuple) -> None:
    conv = prop.conversions[key]
    conv.consumers.remove(edge)
    if not conv.consumers:
        del prop.conversions[key]


def _once(prop, edge: tuple) -> bool:
    """Whether ``edge`` reads its value added by one rank only (``ONCE``)."""
    key = _conversion_into(prop, edge)
    return key is not None and prop.conversions[key].steps == (ONCE,)


def _read_through(prop, value: str, edge: tuple, step: Step) -> None:
    prop.conversions.setdefault((value, (step,)), Conversion(value, (step,))).consumers.append(edge)


def _weight_to_bucket(prop, node: fx.Node, grad: set[str]) -> None:
    """Read ``node``'s weight (argument 1) as a whole parameter whose gradient each rank computes a share of, instead
    of through the conversion the propagation gave it (``f``: a share over this rank's tokens)."""
    edge, weight = (node.name, (1,)), node.args[1]
    key = _conversion_into(prop, edge)
    if key is not None:
        _drop_consumer(prop, key, edge)
    if weight.name in grad:
        _read_through(prop, weight.name, edge, weight_sum(weight))


def _between(down: fx.Node, source: fx.Node) -> list[fx.Node] | None:
    """The ops from the layer's input ``source`` to ``A`` (``down``) that only ``A`` reads (peft's dropout, a cast),
    first to last; None unless ``A`` reads ``source`` through such ops alone."""
    chain, at = [down], down.args[0]
    while at is not source:
        if not isinstance(at, fx.Node) or at.op != "call_function" or at.target not in _PASS_THROUGH \
                or len(at.users) != 1 or not isinstance(at.args[0], fx.Node):
            return None
        chain.insert(0, at)
        at = at.args[0]
    return chain


def _gathered_input(prop, nodes: dict[str, fx.Node], base: fx.Node, projection: Projection) -> tuple:
    """(the edge by which the base's input is gathered, the value gathered): the base's own input edge, or for a base
    on flattened tokens, the flattening reshape's (``sequence_flat.gather_into_flat_regions``)."""
    x = nodes[projection.input]
    edge = next(((base.name, (i,)) for i, a in enumerate(base.args) if a is x), (base.name, (0,)))
    if _conversion_into(prop, edge) is None and x.op == "call_function" and x.target in _RESHAPES \
            and len(x.users) == 1 and isinstance(x.args[0], fx.Node):
        return (x.name, (0,)), x.args[0]
    return edge, x


def _column(prop, nodes: dict[str, fx.Node], adapter: Adapter, projections: dict[str, Projection],
            grad: set[str]) -> bool:
    """``A`` reads the base's gathered input (through peft's dropout, drawn whole as the unsharded model draws it);
    ``B`` reads ``A``'s output as it is (module docstring)."""
    down, base = nodes[adapter.down], nodes[adapter.base]
    into_up = _conversion_into(prop, (adapter.up, (0,)))
    edge, source = _gathered_input(prop, nodes, base, projections[base.name])
    into_base = _conversion_into(prop, edge)
    chain = _between(down, source)
    if into_up is None or into_base is None or chain is None or len(down.users) != 1:
        return False
    gathered, read = prop.conversions[into_base], prop.conversions[into_up]
    if read.source != down.name or read.consumers != [(adapter.up, (0,))] or \
            [s.operator for s in gathered.steps] != [Operator.GATHER, Operator.F] or \
            [s.operator for s in read.steps] != [Operator.GATHER, Operator.F] or \
            any(_conversion_into(prop, (n.name, (0,))) is not None for n in chain):
        return False
    _drop_consumer(prop, into_up, (adapter.up, (0,)))
    gathered.consumers.append((chain[0].name, (0,)))
    for node in chain:
        prop.layouts[node.name] = None  # whole: the dropout's mask and A of the whole sequence
    _weight_to_bucket(prop, down, grad)
    return True


def _scaled_sum(nodes: dict[str, fx.Node], adapter: Adapter, base: fx.Node) -> tuple[list[fx.Node], fx.Node] | None:
    """The scalings by a number between ``B`` and the add of the base's output ``base``, and that add; None unless
    the adapter's output reaches the base's output so, each value read once."""
    at, scales = nodes[adapter.up], []
    while len(at.users) == 1:
        reader = next(iter(at.users))
        if reader.target in _SCALES and reader.args[0] is at and not isinstance(reader.args[1], fx.Node):
            scales.append(reader)
            at = reader
            continue
        if reader.target is aten.add.Tensor and set(reader.args) == {at, base} and len(base.users) == 1 \
                and not reader.kwargs:
            return scales, reader
        return None
    return None


def _row(prop, nodes: dict[str, fx.Node], adapter: Adapter, projections: dict[str, Projection],
         grad: set[str]) -> bool:
    """The base's partial output and the adapter's added, then reduce-scattered once (module docstring)."""
    down, up, base = nodes[adapter.down], nodes[adapter.up], nodes[adapter.base]
    out = nodes[prop.deferred.get(base.name, base.name)]  # a base on flattened tokens: the reshape back
    moved = [nodes[n] for n, to in prop.deferred.items() if to == out.name]
    shard = prop.layouts.get(out.name)
    found = _scaled_sum(nodes, adapter, out)
    if found is None or prop.reduced.get(out.name) is not Operator.REDUCE_SCATTER or \
            prop.reduced.get(down.name) is not Operator.REDUCE_SCATTER or prop.layouts.get(down.name) != shard or \
            len(down.users) != 1 or projections[base.name].spatial:
        return False
    scales, add = found
    partial = [*moved, out, down, up, *scales] if moved else [base, down, up, *scales]
    if prop.layouts.get(add.name) != shard or any(_conversion_into(prop, (n.name, (0,))) for n in [up, *scales]) \
            or _conversion_into(prop, (add.name, (0,))) or _conversion_into(prop, (add.name, (1,))):
        return False
    bias = bias_path(base)
    if bias is None and (projections[base.name].bias is not None or base.target is aten.addmm.default):
        return False
    once = bias is not None and _once(prop, (base.name, bias))  # added once already (``sequence_flat``)
    if bias is not None and not once and _conversion_into(prop, (base.name, bias)) is not None:
        return False
    del prop.reduced[out.name], prop.reduced[down.name]
    prop.reduced[add.name] = Operator.REDUCE_SCATTER
    for node in partial:
        prop.layouts[node.name] = None  # this rank's partial sum over the whole sequence
        prop.deferred[node.name] = add.name
    if bias is not None and not once:  # added by one rank: the reduce-scatter's sum adds it once
        _read_through(prop, base.args[bias[0]].name, (base.name, bias), ONCE)
    _weight_to_bucket(prop, up, grad)
    return True


def carry_sequence_sums(prop, order: list[fx.Node], projections: dict[str, Projection], grad: set[str]) -> None:
    """Put every adapter of the graph on its base layer's all-gather or reduce-scatter (module docstring)."""
    if not order:
        return
    nodes = {n.name: n for n in order}
    moved = False
    for adapter in find_adapters(order[0].graph, projections).values():
        moved |= _column(prop, nodes, adapter, projections, grad) or _row(prop, nodes, adapter, projections, grad)
    if moved:
        # the rewrite inserts conversions in this order, and a gather's readers that are linears become modules
        # taking the gathered value and its shard first (``Regather``): their weights' conversions go in before
        bucketed = {k: c for k, c in prop.conversions.items() if c.steps == (GRAD_SUM,)}
        prop.conversions = {**bucketed, **{k: c for k, c in prop.conversions.items() if k not in bucketed}}
