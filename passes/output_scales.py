"""Trained vectors scaling a layer's output features (IA3's ``ia3_l`` on a projection's output, as peft's
``base_layer(x) * ia3_l.flatten()``): a row-split layer's reduction stays before the product.

The propagation may move a row-split layer's ``g`` past any product by a whole value (``partial``: a sum of
partial products is linear), which pays when a sum over rows follows (a mixture of experts' weighted outputs
indexed back into token order). After a scaling vector nothing smaller follows, and the vector, read through
``f``, would cost an all-reduce of its gradient share in backward. With the ``g`` before the product the vector
multiplies the whole output and its gradient is whole on every rank: the layer costs the base's one all-reduce
each way. Under sequence parallelism the product multiplies this rank's tokens, and the vector's gradient share
joins the end-of-backward bucket (``GRAD_SUM``) instead of an ``f`` of its own (``vector_to_bucket``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import fx

from autotp.passes.graph import meta_val
from autotp.passes.propagation import Conversion
from autotp.passes.steps import COPY, GRAD_SUM

aten = torch.ops.aten

_LINEAR_MOVES = {aten.flatten.using_ints, aten.view.default, aten.reshape.default, aten._unsafe_view.default,
                 aten.unsqueeze.default, aten.to.dtype, aten._to_copy.default}
"""Ops taking a vector to the form a product reads (peft's ``flatten``, a cast), each linear in it."""


@dataclass(frozen=True)
class VectorScale:
    """A product of a projection's output by a trained vector (node names)."""

    product: str
    path: tuple[int]
    """Where the product reads the vector."""
    vector: str
    """The parameter's ``get_attr``."""
    reader: str
    """The node reading the parameter on the way to the product."""


def _only_reader(node: fx.Node) -> fx.Node | None:
    readers = [u for u in node.users if u.target is not aten._assert_tensor_metadata.default]
    return readers[0] if len(readers) == 1 else None


def _by_number(node: fx.Node) -> bool:
    """A product of a tensor (first) by a number (peft's ``ia3_l * scaling``)."""
    return node.target is aten.mul.Tensor and len(node.args) == 2 and isinstance(node.args[1], (int, float))


def _trained_vector(value, features: int) -> tuple[fx.Node, fx.Node] | None:
    """(parameter, the node reading it) when ``value`` is a parameter of ``features`` elements taken to its form
    through linear moves, each read by the next alone."""
    at = value
    while isinstance(at, fx.Node) and at.op == "call_function" and (at.target in _LINEAR_MOVES or _by_number(at)):
        first = at.args[0]
        if not isinstance(first, fx.Node) or _only_reader(first) is not at:
            return None
        if first.op == "get_attr":
            ok = meta_val(first).numel() == features and meta_val(first).dtype.is_floating_point
            return (first, at) if ok else None
        at = first
    return None


def vector_scales(graph: fx.Graph, projections: dict) -> list[VectorScale]:
    """Every product of a projection's output by a trained per-output-feature vector (module docstring)."""
    nodes = {n.name: n for n in graph.nodes}
    found = []
    for name in projections:
        node = nodes.get(name)
        product = _only_reader(node) if node is not None else None
        if product is None or product.target is not aten.mul.Tensor or len(product.args) != 2 or product.kwargs:
            continue
        i = 1 if product.args[0] is node else 0
        features = meta_val(node).shape[-1] if meta_val(node) is not None else None
        got = _trained_vector(product.args[i], features) if isinstance(features, int) else None
        if got is not None:
            found.append(VectorScale(product.name, (i,), got[0].name, got[1].name))
    return found


def to_bucket(prop, edge: tuple, param: str, reader_edge: tuple, grad: set[str]) -> bool:
    """Read ``param`` into the end-of-backward bucket (``GRAD_SUM``, at ``reader_edge``) in place of the ``f``
    through which ``edge`` reads a value made from it linearly: the ``f`` summed the gradient share of that value,
    the bucket sums ``param``'s, the same sum. Whether it did (not when ``edge`` reads no plain ``f``, or the
    parameter is frozen or already read through a conversion)."""
    key = next((k for k, c in prop.conversions.items() if edge in c.consumers), None)
    if key is None or prop.conversions[key].steps != (COPY,) or param not in grad or any(
            reader_edge in c.consumers for c in prop.conversions.values()):
        return False
    conv = prop.conversions[key]
    conv.consumers.remove(edge)
    if not conv.consumers:
        del prop.conversions[key]
    prop.conversions.setdefault((param, (GRAD_SUM,)), Conversion(param, (GRAD_SUM,))).consumers.append(reader_edge)
    return True


def vectors_to_bucket(prop, scales: list[VectorScale], grad: set[str]) -> bool:
    """``to_bucket`` for each scaling vector a product reads through ``f`` (sequence parallelism)."""
    moved = False
    for scale in scales:
        moved |= to_bucket(prop, (scale.product, scale.path), scale.vector, (scale.reader, (0,)), grad)
    return moved
