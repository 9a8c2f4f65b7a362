"""Small graph-editing helpers (the rewriter is the only code that changes graphs)."""

from __future__ import annotations

import copy
import warnings

import torch
from torch import fx, nn

from autotp.passes.graph import ArgPath

STANDS_FOR = "autotp_stands_for"
"""``node.meta`` key on a rank-graph node whose value is that of an original node (the reduced output of a
row-split projection, a random op's module), so the checker can compare it with the unsharded value."""


def with_arg(node: fx.Node, path: ArgPath, value) -> None:
    """Set the argument of ``node`` at ``path`` (``(index,)``, ``(index, list_index)`` or ``("kw", name)``)."""
    if path[0] == "kw":
        node.kwargs = {**node.kwargs, path[1]: value}
        return
    args = list(node.args)
    if len(path) > 1:
        inner = list(args[path[0]])
        inner[path[1]] = value
        args[path[0]] = type(node.args[path[0]])(inner)
    else:
        args[path[0]] = value
    node.args = tuple(args)


def copy_graph_module(source: fx.GraphModule, class_name: str = "AutotpRankModule") -> fx.GraphModule:
    """A new GraphModule over a copy of ``source``'s graph; its attributes still point at the source's."""
    with warnings.catch_warnings():
        # torch's pytree deprecates LeafSpec isinstance checks that its own deepcopy still triggers.
        warnings.filterwarnings("ignore", category=FutureWarning)
        graph = copy.deepcopy(source.graph)  # copies nodes (shallow meta) and the pytree codegen
    return fx.GraphModule(source, graph, class_name=class_name)


def set_tensor(gm: nn.Module, target: str, value: torch.Tensor) -> None:
    """Register ``value`` at dotted ``target`` as a parameter (if it is one) or a buffer."""
    owner, _, name = target.rpartition(".")
    module = gm.get_submodule(owner) if owner else gm
    if isinstance(value, nn.Parameter):
        module.register_parameter(name, value)
    else:
        module.register_buffer(name, value)


def get_tensor(gm: nn.Module, target: str):
    """The tensor (or other attribute) a ``get_attr`` ``target`` names in ``gm``; None where there is none."""
    owner, _, name = target.rpartition(".")
    try:
        return getattr(gm.get_submodule(owner) if owner else gm, name, None)
    except AttributeError:  # no such submodule
        return None


def move_before(node: fx.Node, later: fx.Node) -> None:
    """Move ``node`` (and what it reads that comes after ``later``) just before ``later``: for a value that reads
    nothing computed between them (an adapter's lookup, a norm of the weights) joining ``later``'s collective."""
    position = {n: i for i, n in enumerate(later.graph.nodes)}
    if position[node] < position[later]:
        return
    for arg in node.all_input_nodes:
        move_before(arg, later)
    later.prepend(node)
