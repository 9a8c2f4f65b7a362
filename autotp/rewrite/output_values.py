"""What a training step may do with a split model output it does not return: skip the copy that only changed its
layout, and overwrite it in place while computing the loss (as Megatron's vocab-parallel cross-entropy overwrites
its logits). Each is decided from the graph, once, at rewrite time.

Both matter for the logits: B×T×V/tp floats per rank, where each fresh buffer costs its page faults as well as
its bandwidth (on the CPU benchmark, the in-place loss alone is 7% of a step).
"""

from __future__ import annotations

import torch
from torch import fx

from autotp.rewrite.columns import OverlappedColumnLinear, RegatheredLinear

aten = torch.ops.aten

ALIASING_VIEWS = frozenset({aten.transpose.int, aten.permute.default, aten.view.default, aten.t.default,
                            aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.default, aten.alias.default,
                            aten._unsafe_view.default})
"""Views whose result shares all of its input's elements, none twice (an in-place write through them is a write
to the input; ``expand`` and overlapping views are not among them)."""

FRESH_WITHOUT_SAVING = frozenset({aten.linear.default, aten.matmul.default, aten.mm.default, aten.addmm.default,
                                  aten.bmm.default, aten.einsum.default})
"""Ops whose result is a new tensor that their own backward does not read (a projection saves its operands)."""

SAVING_NO_OUTPUT_MODULES = (OverlappedColumnLinear, RegatheredLinear)
"""autotp's fused projections (``rewrite.columns``): they, too, save only their operands."""


def layout_copy(node: fx.Node) -> bool:
    """A copy that changes only the memory layout: ``x.contiguous()``, ``x.clone()``."""
    if node.op != "call_function" or not node.args or not isinstance(node.args[0], fx.Node):
        return False
    if node.target is aten.contiguous.default:
        return True
    layout = node.kwargs.get("memory_format", torch.preserve_format)
    return node.target is aten.clone.default and layout in (torch.preserve_format, torch.contiguous_format)


def _fresh(node: fx.Node, gm: fx.GraphModule) -> bool:
    if node.op == "call_function":
        return node.target in FRESH_WITHOUT_SAVING
    return node.op == "call_module" and isinstance(gm.get_submodule(node.target), SAVING_NO_OUTPUT_MODULES)


def overwritable(gather: fx.Node, gm: fx.GraphModule) -> bool:
    """Whether the split value ``gather`` (a model output's ``OutputGather``) reads may be overwritten once the
    forward is done: it is (a view of) a fresh tensor from an op that does not save it, nothing but that chain of
    views and the gather reads any of it, and the model returns the gather once; so no backward needs its values
    and the caller holds no other alias."""
    chain = [gather.args[0]]
    while chain[-1].op == "call_function" and chain[-1].target in ALIASING_VIEWS:
        chain.append(chain[-1].args[0])
    if not _fresh(chain[-1], gm):
        return False
    readers = [user for link in chain for user in link.users]
    output = gm.graph.output_node()
    returned = list(gather.users) == [output] and _flat_nodes(output.args).count(gather) == 1
    return returned and readers == [gather, *chain[:-1]]


def _flat_nodes(args) -> list[fx.Node]:
    found: list[fx.Node] = []
    fx.node.map_arg(args, found.append)
    return found
