"""Low-rank adapters on a token embedding: ``E[ids] + s * (A.T[ids] @ B.T)`` (peft's ``lora_embedding_A`` [r, vocab]
and ``lora_embedding_B`` [dim, r]).

The adapter's lookup reads the same ids as the base lookup, in a table of as many rows as the vocabulary. Split
by the vocabulary like the base table (Megatron's ``VocabParallelEmbedding`` for the adapter), each rank looks up
its rows and leaves zeros elsewhere, so its rank-r lookup is a partial sum, as the base lookup's output is. The
rewrite all-reduces both partial sums in one collective (``rewrite.joined_lookups``): the ranks then hold the
whole rank-r lookup, apply the whole ``B`` to it, and every gradient is local (``B``'s gradient reads the whole
lookup; ``A``'s is this rank's rows). The adapter adds no collective, forward or backward.

Nothing here knows peft: the pattern is the arithmetic (a lookup in the transpose of a narrow parameter, by the
ids of a token embedding, projected up and added to that embedding's output).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import fx

from autotp.passes.adapters import _added_to
from autotp.passes.graph import meta_val
from autotp.passes.placement import Shard
from autotp.passes.projections import Embedding, Projection

aten = torch.ops.aten

_TRANSPOSES = {aten.numpy_T.default, aten.t.default}
_THROUGH = {aten.mul.Tensor, aten.div.Tensor, aten.to.dtype, aten._to_copy.default, aten.add.Tensor}
"""Ops between the base lookup and the add of its adapter: a scale (Gemma's embedding), a cast, earlier adapters'
sums (the base value is their first operand)."""


@dataclass(frozen=True)
class EmbeddingAdapter:
    """A low-rank adapter added to a token embedding (node names and ``get_attr`` targets)."""

    lookup: str
    """The adapter's lookup node: ``embedding(A.T, ids)``."""
    table: str
    """``get_attr`` target of ``A`` ([r, vocab]: the lookup reads its transpose)."""
    up: str
    """The projection of the rank-r lookup to the embedding's width (``B``)."""
    base: str
    """The base embedding's lookup node."""
    rank: int


def _table(node: fx.Node) -> fx.Node | None:
    """The parameter whose transpose ``node`` is, if it is one."""
    if node.op == "call_function" and node.target in _TRANSPOSES and node.args[0].op == "get_attr":
        return node.args[0]
    return None


def _reaches(value: fx.Node, base: str) -> bool:
    """Whether ``value`` is the base lookup's output, through scalings, casts and earlier adapters' sums."""
    for _ in range(16):
        if value.name == base:
            return True
        if value.op != "call_function" or value.target not in _THROUGH or not isinstance(value.args[0], fx.Node):
            return False
        value = value.args[0]
    return False


def find_embedding_adapters(graph: fx.Graph, projections: dict[str, Projection],
                            embeddings: dict[str, Embedding]) -> dict[str, EmbeddingAdapter]:
    """Every low-rank adapter on a token embedding in ``graph``, keyed by its lookup node (module docstring)."""
    found: dict[str, EmbeddingAdapter] = {}
    ups = {p.input: p for p in projections.values() if p.bias is None and p.experts == 1 and p.packed is None}
    nodes = {n.name: n for n in graph.nodes}
    for node in graph.find_nodes(op="call_function", target=aten.embedding.default):
        table = _table(node.args[0]) if node.name not in embeddings else None
        up = ups.get(node.name)
        if table is None or up is None or not isinstance(node.args[1], fx.Node):
            continue
        rank, rows = meta_val(table).shape if meta_val(table).dim() == 2 else (0, 0)
        bases = [e for e in embeddings.values() if e.ids == node.args[1].name and e.num_embeddings == rows]
        other = _added_to(nodes[up.node]) if bases else None
        base = next((e for e in bases if other is not None and _reaches(other, e.node)), None)
        if base is None or up.in_features != rank or rank >= min(rows, up.out_features):
            continue
        found[node.name] = EmbeddingAdapter(node.name, table.target, up.node, base.node, int(rank))
    return found


def split_rows_lookup(table: object) -> bool:
    """Whether a lookup in a computed table of this layout is a masked lookup of this rank's rows, its output a
    partial sum: a table split along its rows (dim 0) in one segment, each chunk on one rank (an embedding
    adapter's ``A.T`` split by the vocabulary, as the base table is)."""
    return isinstance(table, Shard) and table.dim == 0 and len(table.segments) == 1 and table.replicas == 1 \
        and table.blocks == 1 and not table.spread


def joined_lookups(analysis, prop) -> dict[str, list[str]]:
    """Of ``analysis`` (``passes.analysis.Analysis``) and its ``prop`` (a ``Propagation``): {base lookup node: the
    adapter lookups reduced with it}: those reduced as it is (the same collective, onto the same layout)."""
    out: dict[str, list[str]] = {}
    for adapter in analysis.embedding_adapters.values():
        reduction = prop.reduced.get(adapter.lookup)
        if reduction is not None and reduction is prop.reduced.get(adapter.base) \
                and prop.layouts.get(adapter.lookup) == prop.layouts.get(adapter.base):
            out.setdefault(adapter.base, []).append(adapter.lookup)
    return out


def lookup_rows(analysis, name: str) -> int | None:
    """The rows of the whole table node ``name`` looks up in (a parameter's, or a computed table's: an adapter's
    ``A.T``), or None when it is no lookup."""
    if name in analysis.embeddings:
        return analysis.embeddings[name].num_embeddings
    node = analysis.nodes[name]
    if node.op == "call_function" and node.target is aten.embedding.default:
        return int(meta_val(node.args[0]).shape[0])
    return None
