"""Parts of the forward that run under ``torch.no_grad()`` and read parameters (a sparse-attention indexer that
picks the keys each query attends to, recurrent steps run without gradients before the last one).

torch.export wraps each such part in a higher-order op around a submodule, which no sharding rule can see into,
so its projections stay whole. Inlined between ``_set_grad_enabled`` calls (the form pre-dispatch
graphs use, and one torch.fx never drops as dead code), its ops are ordinary graph nodes the passes can split,
and they still run without gradients: the same values, the same gradients, no activations kept for backward.
Parts that read no parameter (the rotary tables) are left wrapped: there is nothing in them to split.
"""

from __future__ import annotations

import operator

import torch
from torch import fx

from autotp.torch_private import is_higher_order_op, set_grad_enabled_op
from autotp.passes.graph import named_arg

_WRAP = getattr(torch.ops.higher_order, "wrap_with_set_grad_enabled", None)


def inline_no_grad(gm: fx.GraphModule) -> int:
    """Inline every no-grad higher-order op of ``gm`` that reads a parameter; returns how many were inlined."""
    # every name of a tied parameter: the graph may read it under its second (a tied head written in a no-grad part)
    trainable = {name for name, p in gm.named_parameters(remove_duplicate=False) if p.requires_grad}
    inlined = 0
    for node in list(gm.graph.nodes):
        if _inlinable(gm, node, trainable):
            _inline(gm, node)
            inlined += 1
    if inlined:
        gm.graph.lint()
        gm.delete_all_unused_submodules()
        gm.recompile()
    return inlined


def _inlinable(gm: fx.GraphModule, node: fx.Node, trainable: set[str]) -> bool:
    if _WRAP is None or node.op != "call_function" or node.target is not _WRAP or node.args[0] is not False:
        return False
    body = getattr(gm, node.args[1].target, None)
    if not isinstance(body, fx.GraphModule):
        return False
    nested = any(n.op == "call_function" and is_higher_order_op(n.target)
                 for n in body.graph.nodes)
    reads_parameter = any(a.op == "get_attr" and a.target in trainable for a in node.args[2:]
                          if isinstance(a, fx.Node))
    every_use_unpacks = all(u.op == "call_function" and u.target is operator.getitem for u in node.users)
    return reads_parameter and not nested and every_use_unpacks


def _inline(gm: fx.GraphModule, node: fx.Node) -> None:
    graph, body = gm.graph, getattr(gm, node.args[1].target)
    stack = node.meta.get("nn_module_stack")
    with graph.inserting_before(node):
        was_enabled = graph.call_function(torch.is_grad_enabled, ())
        graph.call_function(set_grad_enabled_op(), (False,))
        env: dict[fx.Node, object] = {}
        inputs = iter(node.args[2:])
        outputs = ()
        for inner in body.graph.nodes:
            if inner.op == "placeholder":
                env[inner] = next(inputs)
            elif inner.op == "output":
                outputs = fx.map_arg(inner.args[0], lambda a: env[a])
            elif inner.op == "get_attr":  # a constant of the body: moved to the parent under a fresh name
                name = _fresh_attr(gm, f"{node.args[1].target}_{inner.target}")
                setattr(gm, name, getattr(body, inner.target))
                env[inner] = graph.get_attr(name)
                env[inner].meta = dict(inner.meta)
            elif _returns_its_input(inner):  # the same tensor, gradient and all: read the input itself
                env[inner] = env[inner.args[0]]
            else:
                copied = graph.node_copy(inner, lambda a: env[a])
                if stack is not None and not copied.meta.get("nn_module_stack"):
                    copied.meta["nn_module_stack"] = dict(stack)  # name the module the part ran in
                env[inner] = copied
        graph.call_function(set_grad_enabled_op(), (was_enabled,))
    for user in list(node.users):
        user.replace_all_uses_with(outputs[user.args[1]])
        graph.erase_node(user)
    graph.erase_node(node)


_RETURNING_SELF = (torch.ops.aten.to.dtype, torch.ops.aten.to.dtype_layout, torch.ops.aten.to.device,
                   torch.ops.aten.type_as.default, torch.ops.aten.contiguous.default)


def _returns_its_input(node: fx.Node) -> bool:
    """A cast to the dtype and device its input has (or ``contiguous`` of a contiguous one): it returns ``x``
    itself, which still carries its gradient even under no_grad (torch.export may hand such a value out of the
    part, for use outside it)."""
    if node.op != "call_function" or node.target not in _RETURNING_SELF or named_arg(node, "copy", False):
        return False
    before, after = node.args[0].meta.get("val"), node.meta.get("val")
    if not (isinstance(before, torch.Tensor) and isinstance(after, torch.Tensor)):
        return False
    layout = named_arg(node, "memory_format", None)
    if node.target is torch.ops.aten.contiguous.default:
        return before.is_contiguous(memory_format=layout or torch.contiguous_format)
    return (layout in (None, torch.preserve_format) and before.dtype == after.dtype
            and before.device == after.device)


def _fresh_attr(gm: fx.GraphModule, base: str) -> str:
    base = base.replace(".", "_")
    name, i = base, 0
    while hasattr(gm, name):
        i += 1
        name = f"{base}_{i}"
    return name
