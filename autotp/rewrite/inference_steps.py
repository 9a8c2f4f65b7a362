"""A generation step's operators in their inference-only forms: a step runs under ``torch.inference_mode`` once per
token and is never differentiated, so what a graph carries for its backward pass only costs time there.

Four rewrites, each computing what the graph computed (the products to float32 rounding, the rest bit for bit):

- the tensor-parallel modules lose their autograd functions: Megatron's ``f`` (an identity forward) is dropped,
  ``g`` calls the all-reduce itself, the overlapped column projection is a plain ``linear`` (an autograd function's
  ``apply`` measured about 12 µs even under inference mode; a 6-layer Llama's decode step made 26 of them);
- ``linear`` runs on oneDNN's matrix product over the weight as it is stored, where that applies (float32 on the
  CPU, a contiguous weight): a decode step's matrix-vector products read every weight once per token, and oneDNN's
  kernel read them 8-12% faster than ``F.linear``'s (one thread, the weights of a rank of the benchmark's Llama;
  about 18% at 64 rows). The training module's own weights, no copy;
- grouped-query attention: K/V heads repeated for their query heads (``unsqueeze(2)``, ``expand``, ``reshape``: a
  copy of the layer's whole cache every step) go to ``scaled_dot_product_attention`` as they are, with
  ``enable_gqa`` (the same bits on the CPU, half its time at batch 1);
- the tensors the step reads become direct attributes of its module: the generated code fetched each weight
  through its module path (``getattr(self.model.model.layers, "0").self_attn.q_proj.weight``, 7 attribute
  lookups), 0.15-0.3 ms a step for a 6-layer Llama's 60 tensors. The same tensor objects, so training's
  in-place updates still reach the step.
"""

from __future__ import annotations

import torch
from torch import fx, nn
from torch.nn import functional as F

from autotp.rewrite.collectives import CopyToTP, ReduceFromTP
from autotp.rewrite.columns import OverlappedColumnLinear
from autotp.rewrite.graph_edit import set_tensor

aten = torch.ops.aten

_ONEDNN = getattr(torch.ops.mkldnn, "_linear_pointwise", None) if torch.backends.mkldnn.is_available() else None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, on oneDNN's kernel where it applies (float32 CPU tensors, a contiguous 2-D
    weight, no autograd: the oneDNN call has no backward)."""
    if (_ONEDNN is not None and x.dtype == torch.float32 and weight.dtype == torch.float32 and x.is_cpu
            and weight.is_cpu and weight.dim() == 2 and weight.is_contiguous() and not torch.is_grad_enabled()
            and (bias is None or (bias.dtype == torch.float32 and bias.is_cpu))):
        return _ONEDNN.default(x, weight, bias, "none", [None], "")
    return F.linear(x, weight, bias)


def _repeats_heads(kv: torch.Tensor, expanded: list, merged: list) -> bool:
    """Whether ``kv.unsqueeze(2).expand(expanded).reshape(merged)`` repeats each head of a ``[batch, heads, length,
    dim]`` tensor for a group of consecutive heads (what ``enable_gqa`` does), and nothing else."""
    if kv.dim() != 4 or len(expanded) != 5 or len(merged) != 4:
        return False
    b, h, n, d = kv.shape
    kept = all(s in (-1, k) for s, k in zip((expanded[0], expanded[1], expanded[3], expanded[4]), (b, h, n, d)))
    group = expanded[2]
    return kept and group > 0 and list(merged) in ([b, h * group, n, d], [b, -1, n, d])


def grouped_attention(query, key, value, key_sizes, value_sizes, *args, **kwargs):
    """``scaled_dot_product_attention(query, repeat(key), repeat(value), ...)``, where ``repeat`` is ``unsqueeze(2)``,
    ``expand`` to the given ``(expanded, merged)`` sizes and ``reshape``: with ``enable_gqa`` when those repeat each
    head for a group of query heads (checked at run time: the sizes are symbolic in the graph) on the CPU (where
    the kernel was measured to give the same bits), else as written."""
    group = key_sizes[0][2]
    if (query.is_cpu and query.dim() == 4 and _repeats_heads(key, *key_sizes) and _repeats_heads(value, *value_sizes)
            and value_sizes[0][2] == group and value.shape[1] == key.shape[1]
            and query.shape[1] == key.shape[1] * group):
        return aten.scaled_dot_product_attention.default(query, key, value, *args, enable_gqa=True, **kwargs)
    key, value = (t.unsqueeze(2).expand(e).reshape(m) for t, (e, m) in ((key, key_sizes), (value, value_sizes)))
    return aten.scaled_dot_product_attention.default(query, key, value, *args, **kwargs)


def _is_call(node, target) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target is target


def _repeat_of(node) -> tuple[fx.Node, list, list] | None:
    """(the K/V node, expand sizes, reshape sizes) when ``node`` is ``reshape(expand(unsqueeze(kv, 2)))`` read
    only by the attention."""
    if not _is_call(node, aten.reshape.default) or len(node.users) != 1:
        return None
    expand = node.args[0]
    if not _is_call(expand, aten.expand.default) or len(expand.users) != 1 or len(expand.args) != 2:
        return None
    unsqueeze = expand.args[0]
    if not _is_call(unsqueeze, aten.unsqueeze.default) or len(unsqueeze.users) != 1 or unsqueeze.args[1] != 2:
        return None
    return unsqueeze.args[0], list(expand.args[1]), list(node.args[1])


def _group_attention(graph: fx.Graph) -> None:
    for node in list(graph.find_nodes(op="call_function", target=aten.scaled_dot_product_attention.default)):
        if node.kwargs.get("enable_gqa") or len(node.args) < 3:
            continue
        key, value = _repeat_of(node.args[1]), _repeat_of(node.args[2])
        if key is None or value is None or node.args[1] is node.args[2]:
            continue
        old = node.args[1:3]
        with graph.inserting_before(node):
            new = graph.call_function(grouped_attention, (node.args[0], key[0], value[0], key[1:], value[1:],
                                                          *node.args[3:]), dict(node.kwargs))
        node.replace_all_uses_with(new)
        graph.erase_node(node)
        for repeat in old:  # reshape, expand, unsqueeze: now unread
            for dead in (repeat, repeat.args[0], repeat.args[0].args[0]):
                graph.erase_node(dead)


def _plain_modules(gm: fx.GraphModule) -> None:
    graph = gm.graph
    for node in list(graph.find_nodes(op="call_module")):
        module = gm.get_submodule(node.target)
        if type(module) is CopyToTP:  # its forward is the identity; it exists for its backward's all-reduce
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)
        elif type(module) is ReduceFromTP:
            gm.set_submodule(node.target, AllReduce(module.comm))
        elif type(module) is OverlappedColumnLinear:
            with graph.inserting_before(node):
                new = graph.call_function(aten.linear.default, node.args, dict(node.kwargs))
            node.replace_all_uses_with(new)
            graph.erase_node(node)


class AllReduce(nn.Module):
    """Megatron's ``g`` forward alone, an all-reduce over ``comm``: for graphs that are never differentiated."""

    def __init__(self, comm):
        super().__init__()
        self.comm = comm

    def forward(self, x):
        return self.comm.all_reduce(x)


def _direct_tensors(gm: fx.GraphModule) -> None:
    for node in gm.graph.find_nodes(op="get_attr"):
        value = gm.get_submodule(node.target.rpartition(".")[0]) if "." in node.target else None
        value = getattr(value, node.target.rpartition(".")[2], None) if value is not None else None
        if isinstance(value, torch.Tensor):
            name = "tensor_" + node.target.replace(".", "_")
            while getattr(gm, name, value) is not value:  # another path flattened to the same name
                name += "_"
            set_tensor(gm, name, value)
            node.target = name


def inference_step(gm: fx.GraphModule) -> fx.GraphModule:
    """``gm`` (a rank's generation step, run only under inference mode) with the rewrites above, recompiled."""
    _direct_tensors(gm)
    _plain_modules(gm)
    for node in list(gm.graph.find_nodes(op="call_function", target=aten.linear.default)):
        node.target = linear
    _group_attention(gm.graph)
    gm.delete_all_unused_submodules()  # the module paths the tensors were read through, the dropped modules
    gm.recompile()
    return gm
