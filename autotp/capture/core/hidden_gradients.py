"""Parameters whose gradient only a custom autograd Function's backward gives.

A non-strict torch.export traces a ``torch.autograd.Function``'s forward and never its backward. Most such
forwards are differentiable ops, and training then differentiates them (``Captured.custom_functions`` names the
Function in the plan's notes). Reversible layers are not: Reformer's ``_ReversibleFunction`` runs its layers
under ``torch.no_grad()`` in the forward and recomputes them in its backward, which is where their parameters'
gradients come from. In the graph those parameters are read only where gradients are off, so a split model
would train without their gradients (or fail in ``backward`` where nothing else needs one). Such a capture is
refused in training mode, naming the layers and the Function.
"""

from __future__ import annotations

import torch
from torch import fx

from autotp.capture.core.replay import INFERENCE_ONLY
from autotp.torch_private import set_grad_enabled_op
from autotp.errors import CaptureError

_WRAP = getattr(torch.ops.higher_order, "wrap_with_set_grad_enabled", None)
_DETACH = (torch.ops.aten.detach.default, torch.Tensor.detach)


def refuse_hidden_gradients(gm: fx.GraphModule, functions: set[str], names: dict[str, str], training: bool) -> None:
    """Raise ``CaptureError`` when, in a train-mode capture whose forward applied the custom autograd
    ``functions``, a trainable parameter the graph reads gets no gradient from the graph. ``names`` maps a
    ``get_attr`` target to the parameter's original name."""
    if not training or not functions:
        return
    starved = sorted(names.get(t, t) for t in starved_parameters(gm))
    if starved:
        layers = sorted({name.rpartition(".")[0] or name for name in starved})
        shown = ", ".join(layers[:4]) + (f" and {len(layers) - 4} more" if len(layers) > 4 else "")
        raise CaptureError(
            f"cannot capture the model for training: the captured graph gives no gradient to {len(starved)} "
            f"parameters the forward reads (those of {shown}), while the model's own backward does: the forward "
            f"applies custom autograd Function(s) {', '.join(sorted(functions))}, which run(s) layers without "
            "gradients and give(s) them their gradients in a backward of its own (reversible layers recompute "
            "their activations there); torch.export captures forwards only, so a split model would train them "
            f"without gradients. {INFERENCE_ONLY}")


def starved_parameters(gm: fx.GraphModule) -> set[str]:
    """``get_attr`` targets of the trainable parameters the graph reads but gives no gradient: no path from them
    to an output runs with gradients on (``_set_grad_enabled`` spans, no-grad higher-order ops, ``detach``)."""
    trainable = {name for name, p in gm.named_parameters() if p.requires_grad}
    requires = _requires_grad(gm.graph, trainable)
    reached = _reached_from_output(gm.graph, requires)
    return {n.target for n in gm.graph.find_nodes(op="get_attr")
            if n.target in trainable and n.users and n not in reached}


def _requires_grad(graph: fx.Graph, trainable: set[str]) -> set[fx.Node]:
    """The nodes whose value requires grad, with the grad mode tracked through the graph in order."""
    out: set[fx.Node] = set()
    enabled, recorded = True, {}
    for node in graph.nodes:
        if node.op == "get_attr":
            if node.target in trainable:
                out.add(node)
            continue
        if node.op != "call_function":
            continue
        if node.target is torch.is_grad_enabled:
            recorded[node] = enabled
        elif node.target is set_grad_enabled_op():
            mode = node.args[0]
            enabled = recorded.get(mode, True) if isinstance(mode, fx.Node) else bool(mode)
        elif node.target is _WRAP and _WRAP is not None:
            if node.args[0] and any(a in out for a in node.all_input_nodes):
                out.add(node)
        elif enabled and node.target not in _DETACH and any(a in out for a in node.all_input_nodes):
            out.add(node)
    return out


def _reached_from_output(graph: fx.Graph, requires: set[fx.Node]) -> set[fx.Node]:
    """The nodes that require grad from which a chain of such nodes reaches the graph's output."""
    stack = [a for n in graph.find_nodes(op="output") for a in n.all_input_nodes if a in requires]
    seen = set(stack)
    while stack:
        for parent in stack.pop().all_input_nodes:
            if parent in requires and parent not in seen:
                seen.add(parent)
                stack.append(parent)
    return seen
