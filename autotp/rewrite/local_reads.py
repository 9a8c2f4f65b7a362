"""Graphs that read DTensor parameters as local tensors: a ``get_attr`` followed by a differentiable ``to_local``.

The parallel module's parameters state their tensor-parallel layout as DTensors (``runtime.tp_params``), while
every rank graph computes on this rank's local tensors, exactly as it was rewritten to. Backward, ``to_local``
hands the local gradient back as a DTensor of the parameter's placement.
"""

from __future__ import annotations

import torch
from torch import fx, nn
from torch.distributed.tensor import DTensor

from autotp.rewrite.data_writes import data_of


def to_local(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s local piece, differentiably (a graph's op after reading a DTensor parameter); a plain tensor as
    it is."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def read_locally(gm: fx.GraphModule) -> None:
    """Follow every ``get_attr`` of a DTensor parameter in ``gm`` by ``to_local``, so the graph computes on local
    tensors. A ``.data`` write (``data_writes``) keeps reading the parameter itself: it writes in place, outside
    autograd."""
    changed = False
    for node in list(gm.graph.find_nodes(op="get_attr")):
        if not isinstance(_attr(gm, node.target), DTensor) or any(u.target is to_local for u in node.users):
            continue
        with gm.graph.inserting_after(node):
            reader = gm.graph.call_function(to_local, (node,))
        node.replace_all_uses_with(reader, delete_user_cb=lambda user: user is not reader and user.target is not data_of)
        changed = True
    if changed:
        gm.graph.lint()
        gm.recompile()


def _attr(gm: nn.Module, target: str):
    owner, _, name = target.rpartition(".")
    try:
        return getattr(gm.get_submodule(owner) if owner else gm, name)
    except AttributeError:
        return None
