"""A vocabulary tp does not divide, split unevenly: which sizes propagation may leave uncut by tp, and where the
uneven split reaches a value it cannot stay exact in.

Megatron pads such a vocabulary to a multiple of tp; autotp cuts it as ``torch.tensor_split`` does
(``placement.chunk_span``: the first ``V % tp`` ranks hold one row more), so the logits keep their size. Every
rank's chunk of the vocabulary then differs in length, which the rewrite honours where the split stays the
vocabulary itself, one dim of size V: the lookup's rows, the head's outputs, the logits through elementwise ops,
reshapes keeping that dim (each rank's own width), sums over it, the vocab-parallel cross-entropy and the
gathers (padded to the longest chunk). Anything else the split reaches (the dim reshaped, repeated, concatenated
with another part, averaged: rules that assume equal chunks) is a violation, so the planner keeps the
vocabulary whole there.
"""

from __future__ import annotations

from collections.abc import Mapping

from autotp.passes.placement import Shard
from autotp.passes.propagation import Propagation, Violation
from autotp.passes.steps import Operator
from torch import fx


def uneven_vocabulary(vocab, tp: int) -> int | None:
    """The vocabulary's size when a split over ``tp`` cuts it unevenly (at least one row per rank), else None."""
    if vocab is None or vocab.vocab_size % tp == 0 or vocab.vocab_size < tp:
        return None
    return vocab.vocab_size


def is_the_vocabulary(violation: Violation, vocab) -> bool:
    """Whether ``violation`` is the vocabulary's own size, at a lookup or along the logits of the heads."""
    if violation.size != vocab.vocab_size:
        return False
    return violation.node in vocab.embeddings or bool(violation.origins) and violation.origins <= set(vocab.heads)


def _shards(layout) -> list[Shard]:
    items = layout if isinstance(layout, tuple) else (layout,)
    return [x for x in items if isinstance(x, Shard)]


def _why_not(node: fx.Node, layout, prop: Propagation, size: int) -> str | None:
    """Why a value the uneven split reaches cannot keep it exact (None: it can)."""
    if prop.reduced.get(node.name) is Operator.MEAN:
        return "a mean over the vocabulary (the ranks' means are of unequal counts)"
    for shard in _shards(layout):
        if shard.segments != (size,):
            return f"the vocabulary reshaped or joined into parts {list(shard.segments)}"
        if shard.blocks != 1 or shard.replicas != 1:
            return "the vocabulary repeated into blocks"
    return None


def uneven_violations(graph: fx.Graph, prop: Propagation, params: Mapping[str, Shard], size: int,
                      lookups: set[str]) -> list[Violation]:
    """Where the split of the vocabulary parameters (``params``: ``get_attr`` target -> layout) reaches a value
    that cannot stay exact cut unevenly, following the split from those parameters through every value it
    reaches; the embedding ``lookups`` end it (their sums over the ranks are whole)."""
    reached: set[str] = set()
    found = []
    for node in graph.nodes:
        if node.op == "get_attr":
            if any(s.segments == (size,) for s in _shards(params.get(node.target))):
                reached.add(node.name)
            continue
        if node.name in lookups or not any(a.name in reached for a in node.all_input_nodes):
            continue
        layout = prop.layouts.get(node.name)
        why = _why_not(node, layout, prop, size)
        if why is not None:
            found.append(Violation(node.name, size, f"{why}, cut unevenly",
                                   prop.origins.get(node.name, frozenset())))
        if _shards(layout):
            reached.add(node.name)
    return found
