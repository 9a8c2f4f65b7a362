"""DoRA on a row-split layer at the base layer's one collective, forward and backward.

DoRA (``capture.quirks.low_rank_norms`` writes it so) computes a row-split layer's output as ``v * p`` with ``p =
W_j x_j + s B A_j x_j`` this rank's partial sum, ``v = m / n`` (``m`` the trained magnitude, ``n`` the detached
norm of each output row of the adapted weight) and ``n = sqrt(q)`` with ``q`` the rows' sums of squares, a partial
sum over the ranks' input features. As the propagation leaves it, ``q`` is all-reduced on its own (an ``[out]``
vector, forward), and ``p``'s reduction moves past the product by ``v``, which then reads ``v`` through ``f`` (an
all-reduce of its gradient share, backward). This pass puts both on the base's collective:

- forward, ``q`` rides in ``p``'s reduction (``Propagation.riders``): the two are summed side by side in one
  all-reduce, or in one reduce-scatter under sequence parallelism where every rank's piece carries a copy of
  ``q``'s slot (``rewrite.joined_sums``). ``v`` applies after the sum: ``sum_r (v * p_r) = v * sum_r p_r``;
- backward, ``v`` then multiplies the whole output, so ``m``'s gradient is whole on every rank and needs no sum;
  under sequence parallelism it multiplies this rank's tokens, and ``m``'s gradient share joins the
  end-of-backward bucket (``GRAD_SUM``) instead of an ``f`` of its own.

``q`` is read only through a ``detach`` (DoRA's norm takes no gradient), so the rider's backward is none.
Anything in another shape keeps the propagation's layout: exact, at one more collective each way.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import fx

from autotp.passes.adapters import Adapter, adapter_adds, find_adapters
from autotp.passes.output_scales import to_bucket, vector_scales, vectors_to_bucket
from autotp.passes.steps import GRAD_SUM, Operator

aten = torch.ops.aten

_MOVES = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.unsqueeze.default,
          aten.to.dtype, aten._to_copy.default}
"""Ops between ``m / n`` and its product with the layer's output (peft's ``.view(1, -1)``, a cast)."""
_CASTS = {aten.to.dtype, aten._to_copy.default}


@dataclass(frozen=True)
class DoraScale:
    """A row-split DoRA layer's output scale ``v * p`` (node names)."""

    total: str
    """``p``: the base's output plus the adapter's (each rank's partial sum)."""
    scale: str
    """The product ``v * p``."""
    vector: str
    """``v`` as the product reads it (``(m / n).view(1, -1)``)."""
    ratio: str
    """``m / n``."""
    magnitude: str
    """``m``, the trained magnitude (a parameter's ``get_attr``)."""
    squares: str
    """``q``: the rows' sums of squares whose square root is ``n``."""


def _back(node, through) -> fx.Node:
    """The value ``node`` is made from through the ops ``through`` (each of its first argument)."""
    while isinstance(node, fx.Node) and node.op == "call_function" and node.target in through:
        node = node.args[0]
    return node


def _only_reader(node: fx.Node) -> fx.Node | None:
    readers = [u for u in node.users if u.target is not aten._assert_tensor_metadata.default]
    return readers[0] if len(readers) == 1 else None


def _norm_squares(norm) -> fx.Node | None:
    """``q`` when ``norm`` is ``sqrt(q)`` read through casts and a ``detach`` (no gradient reaches ``q``)."""
    at, detached = norm, False
    while isinstance(at, fx.Node) and at.op == "call_function" and at.target in _CASTS | {aten.detach.default}:
        detached |= at.target is aten.detach.default
        at = at.args[0]
    if not detached or not isinstance(at, fx.Node) or at.target is not aten.sqrt.default:
        return None
    squares = at.args[0]
    ok = isinstance(squares, fx.Node) and squares.target is aten.sum.dim_IntList and len(squares.users) == 1
    return squares if ok else None


def _scale_of(total: fx.Node) -> DoraScale | None:
    """The DoRA scale reading ``total`` (an adapter's add), if the one reader of ``total`` is ``v * total``."""
    scale = _only_reader(total)
    if scale is None or scale.target is not aten.mul.Tensor or len(scale.args) != 2 or scale.kwargs:
        return None
    vector = scale.args[1] if scale.args[0] is total else scale.args[0]
    if not isinstance(vector, fx.Node) or vector is total:
        return None
    ratio = _back(vector, _MOVES)
    if not isinstance(ratio, fx.Node) or ratio.target is not aten.div.Tensor or len(ratio.args) != 2:
        return None
    magnitude = _back(ratio.args[0], _CASTS)
    squares = _norm_squares(ratio.args[1])
    if not isinstance(magnitude, fx.Node) or magnitude.op != "get_attr" or squares is None:
        return None
    return DoraScale(total.name, scale.name, vector.name, ratio.name, magnitude.name, squares.name)


def dora_scales(graph: fx.Graph, adapters: dict[str, Adapter]) -> list[DoraScale]:
    """Every DoRA output scale ``v * p`` of ``graph``'s ``adapters`` (module docstring)."""
    nodes = {n.name: n for n in graph.nodes}
    found = (_scale_of(nodes[add]) for add in sorted(adapter_adds(graph, adapters)))
    return [s for s in found if s is not None]


def join_norm_sums(prop, nodes: dict[str, fx.Node], scales: list[DoraScale], grad: set[str]) -> None:
    """Put each DoRA layer's sums of squares in its output's reduction, and its magnitude's gradient share, where
    the product reads ``v`` through ``f`` (sequence parallelism), in the end-of-backward bucket (module docstring)."""
    for scale in scales:
        carried = prop.reduced.get(scale.total)
        if carried not in (Operator.G, Operator.REDUCE_SCATTER) or prop.reduced.get(scale.squares) is not Operator.G \
                or prop.layouts.get(scale.squares) is not None:
            continue
        prop.riders.setdefault(scale.total, []).append(scale.squares)
        _magnitude_to_bucket(prop, nodes, scale, grad)


def _magnitude_to_bucket(prop, nodes: dict[str, fx.Node], scale: DoraScale, grad: set[str]) -> None:
    """Read ``m`` into the bucket in place of ``f`` on ``v`` (``output_scales.to_bucket``): ``v``'s gradient is
    linear in ``m``'s through the division by a whole detached ``n``. Not where ``m`` is read through a cast."""
    product = nodes[scale.scale]
    edge = next((scale.scale, (i,)) for i, a in enumerate(product.args) if a is nodes[scale.vector])
    if nodes[scale.ratio].args[0] is nodes[scale.magnitude]:
        to_bucket(prop, edge, scale.magnitude, (scale.ratio, (0,)), grad)


def scale_products(graph: fx.Graph, adapters: dict[str, Adapter], projections: dict) -> frozenset[str]:
    """The products a partial sum's reduction must not move past: DoRA's ``v * p`` (after it ``v`` would be read
    through ``f``, a backward all-reduce of its gradient, and ``q`` could no longer ride in the reduction of
    ``p``) and a projection's output scaled by a trained vector (IA3's, ``output_scales``)."""
    dora = {s.scale for s in dora_scales(graph, adapters)}
    return frozenset(dora | {s.product for s in vector_scales(graph, projections)})


def join_dora_norms(prop, order: list[fx.Node], projections: dict, grad: set[str]) -> None:
    """``join_norm_sums`` for every DoRA layer of the graph ``order`` walks, and the scaling vectors read through
    ``f`` into the bucket (``output_scales``): the propagation's last step."""
    if not order:
        return
    graph = order[0].graph
    scales = dora_scales(graph, find_adapters(graph, projections))
    join_norm_sums(prop, {n.name: n for n in order}, scales, grad)
    if scales or vectors_to_bucket(prop, vector_scales(graph, projections), grad):
        # the rewrite inserts conversions in this order: the bucket's reads first, as ``carry_sequence_sums`` has them
        bucketed = {k: c for k, c in prop.conversions.items() if c.steps == (GRAD_SUM,)}
        prop.conversions = {**bucketed, **{k: c for k, c in prop.conversions.items() if k not in bucketed}}
