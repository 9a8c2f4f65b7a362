"""The attentions a layout exchanges by ring or Ulysses (``layout.methods``): their SDPA, or their explicit
``softmax(QK^T)V`` chain (``passes.attention_chains``), replaced by a ``RingAttention`` or ``UlyssesAttention`` call
on this rank's queries and its own keys and values (before ``repeat_kv``: the call repeats them itself), so the
all-gather's gathers, and for Ulysses the read of the mask's query rows, are left out (``without_exchanged``) and
the ``repeat_kv`` nodes and the explicit chain go."""

from __future__ import annotations

import dataclasses

import torch
from torch import fx

from autotp.passes.attention_chains import ExplicitAttention
from autotp.passes.sequence_split import ContextLayout
from autotp.planning.context_exchange import kv_source
from autotp.rewrite.comm import Communicator
from autotp.rewrite.context_ring import RingAttention
from autotp.rewrite.context_ulysses import UlyssesAttention

aten = torch.ops.aten
_MODULES = {"ring": RingAttention, "ulysses": UlyssesAttention}


def _exchanged(layout: ContextLayout) -> set[str]:
    return {name for name, method in layout.methods.items() if method in _MODULES}


def without_exchanged(layout: ContextLayout) -> ContextLayout:
    """``layout`` less what the ring and Ulysses calls do themselves: their key/value gathers, their
    ``is_causal`` masks, and (Ulysses: every query over every key) the read of their mask's query rows."""
    mine = _exchanged(layout)
    if not mine:
        return layout
    ulysses = {name for name in mine if layout.methods[name] == "ulysses"}
    owner = layout.owner
    return dataclasses.replace(
        layout, gathers=[(n, a) for n, a in layout.gathers if not ((n, a) in layout.kv and owner(n) in mine)],
        selects=[s for s in layout.selects if owner(s[0]) not in ulysses],
        causal=[n for n in layout.causal if n not in mine])


def _arg(node: fx.Node, index: int, name: str, default=None):
    return node.args[index] if len(node.args) > index else node.kwargs.get(name, default)


def exchange_attention(gm: fx.GraphModule, layout: ContextLayout, comm: Communicator, length: fx.Node) -> None:
    """Replace each ring or Ulysses attention of ``layout`` in ``gm`` (already rewritten by ``apply_context``
    with ``without_exchanged(layout)``; ``length``: its node of the whole sequence length)."""
    mine = _exchanged(layout)
    if not mine:
        return
    graph = gm.graph
    nodes = {n.name: n for n in graph.nodes}
    for index, name in enumerate(n for n in layout.exchanges if n in mine):
        node = nodes[name]
        if name in layout.explicit:
            with graph.inserting_before(node):
                args, causal, scale = _explicit_operands(graph, nodes, layout.explicit[name])
        else:
            args = (node.args[0], kv_source(nodes, layout, node.args[1]), kv_source(nodes, layout, node.args[2]),
                    _arg(node, 3, "attn_mask"))
            causal, scale = bool(_arg(node, 5, "is_causal", False)), _arg(node, 6, "scale")
        n_rep = args[0].meta["val"].shape[1] // args[1].meta["val"].shape[1]
        fixed = None if isinstance(scale, fx.Node) else scale  # a node's value is passed at each call
        module = _MODULES[layout.methods[name]](comm, gm.cp_positions, causal, fixed, n_rep, name in layout.explicit)
        target = f"cp_{layout.methods[name]}_{index}"
        gm.add_module(target, module)
        with graph.inserting_before(node):
            call = graph.call_module(target, (*args, length) + ((scale,) if isinstance(scale, fx.Node) else ()))
        call.meta.update(node.meta)
        node.replace_all_uses_with(call)
        graph.erase_node(node)
        for dead in reversed(list(graph.nodes)):  # repeat_kv's nodes and the explicit chain, read by nothing now
            if not dead.users and dead.op == "call_function" and layout.owner(dead.name) == name:
                graph.erase_node(dead)
    graph.lint()
    gm.recompile()


def _explicit_operands(graph: fx.Graph, nodes: dict, e: ExplicitAttention) -> tuple[tuple, bool, object]:
    """(q, k, v, mask) of an explicit attention for the call, not causal, its scale: a number, or a node of a
    0-dim tensor (``1 / scale`` for a division). The mask is as the rewrite left it (the rank's query rows for the
    ring, whole for Ulysses); ``masked_fill``'s condition (True: masked) becomes the mask of keys that may be seen."""
    mask = nodes[e.mask_op].args[e.mask_arg] if e.mask_op is not None else None
    if mask is not None and not e.added:
        mask = graph.call_function(aten.logical_not.default, (mask,))
    scale = nodes[e.scale] if isinstance(e.scale, str) else e.scale
    if e.divides:
        scale = graph.call_function(aten.reciprocal.default, (scale,)) if isinstance(scale, fx.Node) else 1.0 / scale
    return (nodes[e.q], nodes[e.k], nodes[e.v], mask), False, scale
