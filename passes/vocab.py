"""Find the token embedding and the LM head: the layers split along the vocabulary.

The token embedding is the embedding table indexed by a model input that is as large as a projection
reaching the output (else the largest such table); an LM head is a
projection onto that many outputs whose result reaches the model's output with no other projection
in between (tied to the embedding or not).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import fx

from autotp.passes.graph import is_tensor
from autotp.passes.projections import Embedding, Projection


@dataclass(frozen=True)
class VocabMatch:
    """The vocabulary-indexed layers."""

    vocab_size: int
    embeddings: tuple[str, ...]
    """Token-embedding lookup nodes."""
    heads: tuple[str, ...]
    """LM-head projection nodes."""


def _from_inputs(graph: fx.Graph) -> set[str]:
    """Tensors computed from the values of the model's inputs.

    Only tensor data counts: position ids built from the input's *length* (``arange(T)``) are not
    token ids.
    """
    out: set[str] = set()
    for node in graph.nodes:
        if not is_tensor(node):
            continue
        if node.op == "placeholder" or any(a.name in out for a in node.all_input_nodes):
            out.add(node.name)
    return out


def _reaches_output(node: fx.Node, projections: dict[str, Projection]) -> bool:
    """Whether ``node``'s value flows to the graph output without entering another projection."""
    seen, todo = set(), list(node.users)
    while todo:
        user = todo.pop()
        if user.op == "output":
            return True
        if user.name in seen or user.name in projections:
            continue
        seen.add(user.name)
        todo.extend(user.users)
    return False


def find_vocab(graph: fx.Graph, projections: dict[str, Projection],
               embeddings: dict[str, Embedding]) -> VocabMatch | None:
    """The token embedding(s) and LM head(s), or None if the model has no token embedding."""
    from_inputs = _from_inputs(graph)
    token = [e for e in embeddings.values() if e.ids in from_inputs]
    if not token:
        return None
    nodes = {n.name: n for n in graph.nodes}
    outputs = {p.out_features for p in projections.values() if _reaches_output(nodes[p.node], projections)}
    # A table as large as a head's outputs is the vocabulary; else the largest (position ids computed from
    # the token ids, as RoBERTa's are, index a table too, and it may be the larger).
    vocab = max((e.num_embeddings for e in token), key=lambda size: (size in outputs, size))
    heads = tuple(p.node for p in projections.values()
                  if p.out_features == vocab and _reaches_output(nodes[p.node], projections))
    return VocabMatch(vocab_size=vocab, embeddings=tuple(e.node for e in token if e.num_embeddings == vocab),
                      heads=heads)


def feeds_only_heads(node: fx.Node, projections: dict[str, Projection], heads: tuple[str, ...],
                     adapter_adds: frozenset = frozenset(), adapter_reads: frozenset = frozenset()) -> bool:
    """Whether ``node``'s value goes, alone, straight into an LM head: a chain of single readers whose other
    inputs are parameters (an activation, a norm), as BERT's head transform. Splitting it would gather its
    output again before the vocabulary-split head, which costs more than it saves (Megatron keeps it whole too).
    An add in ``adapter_adds`` (a LoRA adapter's output joining its base's) is passed through: the adapted
    transform is kept whole as the base is, so its adapter adds no collective. A reader in ``adapter_reads`` (an
    adapter on the head reading the head's input: LoRA on ``lm_head``, on BERT's ``decoder``) is the head's own: the
    value still goes only into the head, whose adapter reads it whole as the head does."""
    for _ in range(16):
        readers = [u for u in node.users if (u.users or u.op == "output") and u.name not in adapter_reads]
        if len(readers) != 1:
            return False
        reader = readers[0]
        if reader.name in heads:
            return projections[reader.name].input == node.name
        if reader.name in adapter_adds:
            node = reader
            continue
        if reader.op != "call_function" or reader.name in projections or any(
                a is not node and a.op != "get_attr" for a in reader.all_input_nodes):
            return False
        node = reader
    return False
