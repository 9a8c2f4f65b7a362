"""The attentions a layout exchanges by ring or Ulysses (``layout.methods``): their SDPA replaced by a
``RingAttention`` or ``UlyssesAttention`` call on this rank's queries and its own keys and values (before
``repeat_kv``: the call repeats them itself), so the all-gather's gathers, and for Ulysses the read of the mask's
query rows, are left out (``without_exchanged``) and the ``repeat_kv`` nodes go."""

from __future__ import annotations

import dataclasses

from torch import fx

from autotp.passes.sequence_split import ContextLayout
from autotp.planning.context_exchange import kv_source
from autotp.rewrite.comm import Communicator
from autotp.rewrite.context_ring import RingAttention
from autotp.rewrite.context_ulysses import UlyssesAttention

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
    owner = lambda name: layout.hoisted.get(name, name)  # noqa: E731 - the attention a node feeds
    return dataclasses.replace(
        layout, gathers=[(n, a) for n, a in layout.gathers if not ((n, a) in layout.kv and owner(n) in mine)],
        selects=[s for s in layout.selects if s[0] not in ulysses], causal=[n for n in layout.causal if n not in mine])


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
        q, k, v = node.args[:3]
        k_src, v_src = kv_source(nodes, layout, k), kv_source(nodes, layout, v)
        n_rep = q.meta["val"].shape[1] // k_src.meta["val"].shape[1]
        module = _MODULES[layout.methods[name]](comm, gm.cp_positions, bool(_arg(node, 5, "is_causal", False)),
                                                _arg(node, 6, "scale"), n_rep)
        target = f"cp_{layout.methods[name]}_{index}"
        gm.add_module(target, module)
        with graph.inserting_before(node):
            call = graph.call_module(target, (q, k_src, v_src, _arg(node, 3, "attn_mask"), length))
        call.meta.update(node.meta)
        node.replace_all_uses_with(call)
        graph.erase_node(node)
        for dead in reversed(list(graph.nodes)):  # repeat_kv's nodes, read by nothing now
            if layout.hoisted.get(dead.name) == name and not dead.users:
                graph.erase_node(dead)
    graph.lint()
    gm.recompile()
