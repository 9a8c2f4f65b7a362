"""DoRA's weight norm and output written as ops a split can follow.

peft's DoRA divides a layer's output by the norm of each output row of its adapted weight ``W + s * B @ A``,
computed in the forward (and detached) as ``linalg_norm(W + s * (B(A(eye(in)))).T, dim=1)``: the adapter's
product is made by running its two projections on an identity matrix. Both forms are split-hostile as they
stand: an identity's columns cannot follow ``A``'s split, and ``linalg_norm`` is one op. Written as ``B @ A`` (the
same product, without the identity) and ``sqrt(sum(x * x, dim))`` (the same norm), the product is split as ``A``
or ``B`` is, and a sum over a split dim is a partial sum one all-reduce completes (``rules_compute.reduction``):

- on a column-split base each rank holds whole rows: its rows' norms are local;
- on a row-split base each row's sum of squares is a partial sum over the ranks' input features, summed in the
  forward only (the norm is detached), side by side with the layer's output in its one all-reduce
  (``passes.dora_norms``).

peft adds DoRA's output to the base layer's as ``W x + (v - 1) * W x + v * s * B(A(x))`` (``v``: magnitude over
norm), reading ``W x`` twice; written as DoRA's own ``v * (W x + s * B(A(x)))`` the base's output has one reader,
so a row-split base's partial sum and its adapter's are added before the base's one all-reduce (``passes.partial``),
the adapter adding no all-reduce of activations; ``v`` applies after it (``passes.dora_norms``).

The values are those of the original ops up to float rounding (the same products, summed in another order).
"""

from __future__ import annotations

import torch
from torch import fx

aten = torch.ops.aten


def _val(node):
    return node.meta.get("val") if isinstance(node, fx.Node) else node


def _replace(graph: fx.Graph, node: fx.Node, steps) -> None:
    """Replace ``node`` by the chain ``steps`` ((op, args of the previous value)), each new node carrying ``node``'s
    metadata and its own fake value."""
    fake = getattr(_val(node), "fake_mode", None)
    current = None
    with graph.inserting_before(node):
        for target, args_of in steps:
            args = args_of(current)
            current = graph.call_function(target, args)
            current.meta.update({k: v for k, v in node.meta.items() if k != "val"})
            if fake is not None:
                with fake:
                    current.meta["val"] = target(*[_val(a) for a in args])
    node.replace_all_uses_with(current)
    graph.erase_node(node)


def _identity_product(node: fx.Node) -> tuple[fx.Node, fx.Node] | None:
    """``(B, A)`` when ``node`` is ``linear(linear(eye(n), A), B).T`` (peft's DoRA weight of a LoRA pair)."""
    if node.target is not aten.numpy_T.default or not isinstance(node.args[0], fx.Node):
        return None
    up = node.args[0]
    if up.target is not aten.linear.default or len(up.args) != 2 or not isinstance(up.args[0], fx.Node):
        return None
    down = up.args[0]
    if down.target is not aten.linear.default or len(down.args) != 2 or len(down.users) != 1:
        return None
    eye = down.args[0]
    if not isinstance(eye, fx.Node) or eye.target is not aten.eye.default or len(eye.args) != 1 or eye.kwargs.get(
            "dtype", None) not in (None, _val(down.args[1]).dtype):
        return None
    return up.args[1], down.args[1]


def _detached(node: fx.Node) -> bool:
    """Whether ``node``'s value is read only through casts ending in a ``detach`` (no gradient flows back through
    it: ``sqrt``'s gradient at a zero norm would differ from ``linalg_norm``'s)."""
    readers = [u for u in node.users if u.target is not aten._assert_tensor_metadata.default]
    return bool(readers) and all(u.target is aten.detach.default or (u.target is aten.to.dtype and _detached(u))
                                 for u in readers)


def _plain_norm(node: fx.Node) -> bool:
    """``linalg_norm(x, None, dims)`` read detached: the 2-norm over ``dims``, of a floating point value, that no
    gradient flows through (DoRA's)."""
    args = list(node.args) + [None] * 4
    ord_, dims = node.kwargs.get("ord", args[1]), node.kwargs.get("dim", args[2])
    keepdim = node.kwargs.get("keepdim", args[3] or False)
    return node.target is aten.linalg_norm.default and ord_ is None and isinstance(dims, (list, tuple)) \
        and keepdim is False and "dtype" not in node.kwargs and _detached(node) \
        and _val(node.args[0]).dtype in (torch.float32, torch.float64, torch.bfloat16)  # float16's x * x overflows


def _args(node, target) -> tuple | None:
    """``node``'s two arguments when it is a call of ``target`` with two, else None."""
    ok = isinstance(node, fx.Node) and node.op == "call_function" and node.target is target and len(node.args) == 2
    return tuple(node.args) if ok and not node.kwargs else None


def _dora_sum(node: fx.Node) -> tuple[fx.Node, fx.Node, fx.Node, object] | None:
    """``(v, base, low_rank, s)`` when ``node`` is peft's DoRA output ``base + ((v - 1) * base + (v * low_rank) * s)``
    (``base``: the base layer's output without a bias, ``v``: magnitude over norm, ``s`` a number)."""
    top = _args(node, aten.add.Tensor)
    inner = _args(top[1], aten.add.Tensor) if top else None
    left, right = (_args(inner[0], aten.mul.Tensor), _args(inner[1], aten.mul.Tensor)) if inner else (None, None)
    if not left or not right or left[1] is not top[0] or not isinstance(right[1], (int, float)):
        return None
    minus, scaled = _args(left[0], aten.sub.Tensor), _args(right[0], aten.mul.Tensor)
    if not minus or not scaled or minus[1] != 1 or scaled[0] is not minus[0]:
        return None
    return minus[0], top[0], scaled[1], right[1]


def write_low_rank_norms(gm: fx.GraphModule) -> int:
    """Write DoRA's adapter products and row norms out (module docstring); returns how many nodes were."""
    graph = gm.graph
    done = 0
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        pair = _identity_product(node)
        if pair is not None:
            (b, a), up = pair, node.args[0]
            down = up.args[0]
            _replace(graph, node, [(aten.matmul.default, lambda _: (b, a))])
            for dead in (up, down, down.args[0]):
                if not dead.users:
                    graph.erase_node(dead)
            done += 1
        elif (dora := _dora_sum(node)) is not None:
            # ``v * (base + s * low_rank)``, DoRA's own formula: the base's output has one reader, so a row-split
            # base's partial sum and the adapter's are all-reduced once, ``v`` applied to the sum
            v, base, low_rank, s = dora
            _replace(graph, node, [(aten.mul.Tensor, lambda _: (low_rank, s)),
                                   (aten.add.Tensor, lambda value: (base, value)),
                                   (aten.mul.Tensor, lambda value: (v, value))])
            done += 1
        elif _plain_norm(node):
            x, dims = node.args[0], list(node.kwargs.get("dim", node.args[2] if len(node.args) > 2 else None))
            _replace(graph, node, [(aten.mul.Tensor, lambda _: (x, x)),
                                   (aten.sum.dim_IntList, lambda value: (value, dims)),
                                   (aten.sqrt.default, lambda value: (value,))])
            done += 1
    if done:
        graph.eliminate_dead_code()
        graph.lint()
        gm.recompile()
    return done
