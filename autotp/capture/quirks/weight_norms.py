"""Weight normalisation written out as the ops it is made of, so that its weight can be split.

``torch.nn.utils.parametrizations.weight_norm`` (and the older hook-based ``weight_norm``) compute the weight as
``aten._weight_norm(v, g, dim)``: ``v * (g / ||v||)``, the norm taken over every dim of ``v`` but ``dim``. As one
op it can only run whole. Written out (a sum of squares, a square root, a division and a product), the sum over a
dim split across ranks is a partial sum that an all-reduce completes (``rules_compute.reduction``), every other op
is per element, and ``v`` splits like any parameter: wav2vec2's positional convolution, a grouped convolution
whose weight is normalised over its output and input channels for each kernel tap, is split by whole groups.
"""

from __future__ import annotations

import torch
from torch import fx

aten = torch.ops.aten


def _val(node: fx.Node):
    return node.meta.get("val")


def _expand(graph: fx.Graph, node: fx.Node) -> None:
    """Replace one ``_weight_norm(v, g, dim)`` node by ``v * (g / sqrt(sum(v * v, other dims, keepdim)))``, each
    new node carrying the replaced node's metadata (its module and source line) and its own value's fake tensor."""
    v, g = node.args[0], node.args[1]
    dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)
    v_val = _val(v)
    ndim = v_val.dim()
    dims = list(range(ndim)) if dim == -1 else [d for d in range(ndim) if d != dim % ndim]
    steps = [(aten.mul.Tensor, lambda a: (a, a)), (aten.sum.dim_IntList, lambda a: (a, dims, True)),
             (aten.sqrt.default, lambda a: (a,)), (aten.div.Tensor, lambda a: (g, a)),
             (aten.mul.Tensor, lambda a: (v, a))]
    fake = v_val.fake_mode if hasattr(v_val, "fake_mode") else None
    current, value = v, v_val
    with graph.inserting_before(node):
        for target, args_of in steps:
            args = args_of(current)
            values = [_val(a) if isinstance(a, fx.Node) else a for a in args]
            if fake is not None:
                with fake:
                    value = target(*values)
            current = graph.call_function(target, args)
            current.meta.update({k: v for k, v in node.meta.items() if k != "val"})
            if value is not None:
                current.meta["val"] = value
    node.replace_all_uses_with(current)
    graph.erase_node(node)


def expand_weight_norms(gm: fx.GraphModule) -> int:
    """Write every ``aten._weight_norm`` of ``gm`` out as the ops it computes (see the module's docstring);
    returns how many were."""
    found = list(gm.graph.find_nodes(op="call_function", target=aten._weight_norm.default))
    for node in found:
        _expand(gm.graph, node)
    if found:
        gm.graph.lint()
        gm.recompile()
    return len(found)
