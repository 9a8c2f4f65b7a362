"""Cost model: FLOPs, parameter bytes and activation bytes of every node, as sympy expressions.

Sizes that vary (batch, sequence) stay symbolic, named as the capture named them (``B``, ``T``), so
one analysis serves every batch and sequence length; ``evaluate`` plugs numbers in. Counts are of the
forward pass; backward is taken as twice the forward (the usual estimate for matmul-dominated models).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import sympy
import torch
from torch import fx

from autotp.passes.graph import arg_or_default, is_tensor, meta_val, sizes
from autotp.passes.projections import CONVOLUTIONS, grouped_ops
from autotp.passes.reshapes import static

aten = torch.ops.aten

_MATMULS = {aten.linear.default, aten.addmm.default, aten.mm.default, aten.matmul.default, aten.bmm.default}
_ATTENTION = {aten.scaled_dot_product_attention.default}
_NORMS = {aten.layer_norm.default, aten.rms_norm.default, aten.native_layer_norm.default}
_FREE = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.expand.default,
         aten.permute.default, aten.transpose.int, aten.t.default, aten.numpy_T.default, aten.unsqueeze.default,
         aten.squeeze.dim,
         aten.slice.Tensor, aten.select.int, aten.split.Tensor, aten.split_with_sizes.default,
         aten.alias.default, aten.detach.default, aten.sym_size.int}
"""Ops that only re-index memory: no FLOPs and (as views) no new activation memory."""


@dataclass(frozen=True)
class NodeCost:
    """Forward costs of one node; expressions in the capture's size symbols."""

    flops: sympy.Expr
    activation_bytes: sympy.Expr
    param_count: int = 0


def _numel(shape) -> sympy.Expr:
    return _product(tuple(shape))


@functools.lru_cache(maxsize=4096)
def _product(shape: tuple) -> sympy.Expr:
    # ``_numel`` by the sizes as a tuple (hashable): the costs and the pricing ask it of every node, and a model's
    # blocks repeat their shapes.
    return sympy.Mul(*[sympy.sympify(d) for d in shape]) if shape else sympy.Integer(1)


@functools.lru_cache(maxsize=4096)
def _times(*factors) -> sympy.Expr:
    """The product of ``factors`` (ints and sympy expressions), found once per distinct factors, as ``_product``."""
    return sympy.Mul(*[sympy.sympify(f) for f in factors])


def _matmul_flops(node: fx.Node) -> sympy.Expr:
    """2·(output elements)·(contraction size); the contraction is the last dim of the activation input."""
    x = node.args[1] if node.target is aten.addmm.default else node.args[0]
    return _times(2, _numel(sizes(node)), sizes(x)[-1])


def _attention_flops(node: fx.Node) -> sympy.Expr:
    """QKᵀ and (softmax)·V: 2·2·B·H·T·S·D, the quadratic term in sequence length."""
    q, k = sizes(node.args[0]), sizes(node.args[1])
    return _times(4, _numel(q), k[-2])


def node_cost(node: fx.Node) -> NodeCost:
    """The forward cost of one node."""
    if node.op == "get_attr":
        val = meta_val(node)
        if isinstance(val, torch.Tensor):
            return NodeCost(sympy.Integer(0), sympy.Integer(0), math.prod(val.shape))
        return NodeCost(sympy.Integer(0), sympy.Integer(0))
    if node.op != "call_function" or not is_tensor(node):
        return NodeCost(sympy.Integer(0), sympy.Integer(0))
    out = _numel(sizes(node))
    itemsize = meta_val(node).element_size()
    if node.target in _FREE:
        return NodeCost(sympy.Integer(0), sympy.Integer(0))
    if node.target in _MATMULS or node.target in grouped_ops():
        # A grouped matmul's rows are the tokens routed to its experts (k per token under top-k routing): the
        # sum of every expert's load, each row multiplied by its expert's matrix.
        flops = _matmul_flops(node)
    elif node.target in CONVOLUTIONS:
        # each output element sums its group's input channels over the kernel: the weight's sizes after the first
        flops = _times(2, out, _numel(sizes(node.args[1])[1:]))
    elif node.target in _ATTENTION:
        flops = _attention_flops(node)
    elif node.target in _NORMS:
        flops = _times(5, out)  # mean, variance, normalise, scale, shift
    elif node.target is aten.embedding.default:
        flops = sympy.Integer(0)  # a lookup
    else:
        flops = out  # elementwise and the rest: one operation per output element
    return NodeCost(flops, _times(out, itemsize))


def costs(graph: fx.Graph, trainable: set[str] | None = None) -> dict[str, NodeCost]:
    """The forward cost of every node, keyed by node name.

    Parameters are counted once, at their ``get_attr``; buffers (``trainable`` given) count no parameters. In a
    graph that routes tokens to experts, a data-dependent size (the tokens one expert gets, torch.export's ``u0``)
    is the routing's expected load (``expert_load``).
    """
    out = {}
    load = expert_load(graph)
    for node in graph.nodes:
        cost = node_cost(node)
        if node.op == "get_attr" and trainable is not None and node.target not in trainable:
            cost = NodeCost(cost.flops, cost.activation_bytes)
        if load is not None:
            cost = NodeCost(_loaded(cost.flops, load), _loaded(cost.activation_bytes, load), cost.param_count)
        out[node.name] = cost
    return out


def expert_load(graph: fx.Graph) -> sympy.Expr | None:
    """The tokens each expert gets on average, k/E of the routed rows, from the top-k with the most choices (the
    experts, not a group-limited router's groups): None without one."""
    routings = [n for n in graph.nodes if n.target is aten.topk.default and static(_choices(n)) is not None]
    if not routings:
        return None
    topk = max(routings, key=lambda n: static(_choices(n)))
    rows = _numel(sizes(topk.args[0])) / _choices(topk)
    return rows * arg_or_default(topk, 1, "k", 1) / _choices(topk)


def _choices(topk: fx.Node):
    return sizes(topk.args[0])[arg_or_default(topk, 2, "dim", -1)]


def _loaded(expr, load: sympy.Expr):
    """``expr`` with every data-dependent size (``u0``, ...) set to ``load``."""
    return _substituted(sympy.sympify(expr), load)


@functools.lru_cache(maxsize=4096)
def _substituted(expr: sympy.Expr, load: sympy.Expr) -> sympy.Expr:
    # Every block of a deep model costs the same few expressions: substituting each once (sympy's ``subs`` is
    # most of the costing) keeps costing a graph linear in its nodes at a small constant.
    return expr.subs({u: load for u in expr.free_symbols if u.name.startswith("u")})


def evaluate(expr, values: dict[str, int]) -> float:
    """The value of a cost expression with the size symbols (by name) set to ``values``.

    A size no input determines (data-dependent, as the tokens a mixture-of-experts router sends to one
    expert: torch.export's ``u0``) is costed at ``data_dependent_hint(values)``, the product of the input
    sizes: as if every token went there, an upper bound.
    """
    if isinstance(expr, (int, float)):
        return float(expr)
    return _evaluated(sympy.sympify(expr), tuple(sorted(values.items())))


@functools.lru_cache(maxsize=4096)
def _evaluated(expr: sympy.Expr, values: tuple[tuple[str, int], ...]) -> float:
    # ``evaluate`` by the values as a sorted tuple (hashable): a deep model's blocks repeat their expressions,
    # and the stage split and the pricing evaluate each many times.
    if expr.is_Number:
        return float(expr)
    known = dict(values)
    hint = data_dependent_hint(known)
    return float(expr.subs({s: known.get(s.name, hint) for s in expr.free_symbols}))


def data_dependent_hint(values: dict[str, int]) -> int:
    """The value a data-dependent size is costed at: the product of the known input sizes (B·T for token ids)."""
    return math.prod(values.values()) if values else 1


def tensor_bytes(node: fx.Node, values: dict[str, int]) -> float:
    """Bytes of the tensor ``node`` produces, with the size symbols set to ``values``."""
    return evaluate(_numel(sizes(node)), values) * meta_val(node).element_size()
