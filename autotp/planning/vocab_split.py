"""The vocabulary split: the embedding's rows and the LM head's outputs split over tp ranks (Megatron's
``VocabParallelEmbedding`` and vocab-parallel head), or kept whole.

Kept whole when it cannot be exact (an embedding option the split lookup cannot honour, an op writing to the
table, a size the split reaches that tp does not divide), when the options ask, or when the cost model finds the
split not worth it; each reason goes to the plan's notes.
"""

from __future__ import annotations

from collections.abc import Mapping

from autotp.options import Options, VocabChoice
from autotp.passes.analysis import Analysis
from autotp.passes.graph import arg_or_default
from autotp.passes.placement import Placement, PlacementKind
from autotp.passes.region_match import RegionKind
from autotp.planning.plan import Region
from autotp.planning.machines import Link
from autotp.planning.pricing import (
    training_bytes_per_rank,
    vocab_cost,
    vocab_verdict,
)


def vocab_placements(analysis: Analysis, tp: int, notes: list[str], options: Options, link: Link,
                     values: dict[str, int], others: dict[str, Placement]
                     ) -> tuple[dict[str, Placement], list[Region], tuple[str, ...]]:
    """The vocabulary split (placements keyed by ``get_attr`` target, and regions), unless it cannot be exact or
    ``choices`` keep it whole (then the layers kept whole by choice, as ``options`` ask or the cost model on
    ``link`` finds, at the size symbols' ``values``); the reason goes to ``notes``. ``others``: the plan's other
    split parameters."""
    vocab = analysis.vocab
    if vocab is None or tp == 1:
        return {}, [], ()
    layers = tuple(analysis.layer(n) for n in (*vocab.embeddings, *vocab.heads))
    if options.vocab is VocabChoice.WHOLE:
        notes.append("embedding and LM head kept whole: vocab='whole' was asked for")
        return {}, [], layers
    if vocab.vocab_size < tp:
        notes.append(f"vocabulary of {vocab.vocab_size} is smaller than tp={tp}: embedding and LM head not split along it")
        return {}, [], ()
    out = {analysis.embeddings[e].weight: Placement(PlacementKind.VOCAB, 0) for e in vocab.embeddings}
    for head in vocab.heads:
        p = analysis.projections[head]
        out[p.weight] = Placement(PlacementKind.VOCAB, p.out_dim)
        if p.bias:
            out[p.bias] = Placement(PlacementKind.VOCAB, 0)
    blocker = _vocab_blocker(analysis, out, tp)
    if blocker:
        notes.append(f"embedding and LM head replicated: {blocker}")
        return {}, [], ()
    if options.vocab is VocabChoice.AUTO:
        cost = vocab_cost(analysis, tp, values, link)
        whole, why = vocab_verdict(cost, training_bytes_per_rank(analysis, others | out, tp), options.memory_budget)
        verdict = "kept whole" if whole else "split"
        notes.append(f"vocabulary of {vocab.vocab_size} {verdict} by the cost model ({link.name}, at the "
                     f"plan's batch and sequence): {why}; vocab='split' or 'whole' overrides it")
        if whole:
            return {}, [], layers
    if vocab.vocab_size % tp:
        longer = vocab.vocab_size % tp
        rows = vocab.vocab_size // tp
        notes.append(f"vocabulary of {vocab.vocab_size} is not divisible by tp={tp}: split unevenly, {longer} "
                     f"rank{'s' if longer > 1 else ''} holding {rows + 1} rows and {tp - longer} holding {rows} (Megatron "
                     "pads it instead; the logits keep their size)")
    regions = [Region(RegionKind.EMBEDDING, tuple(analysis.layer(e) for e in vocab.embeddings), ())]
    regions += [Region(RegionKind.LM_HEAD, (analysis.layer(h),), ()) for h in vocab.heads]
    return out, regions, ()


_UNSPLITTABLE_EMBEDDING = {3: "scale_grad_by_freq", 4: "sparse"}
"""``aten.embedding`` options a vocabulary split cannot honour: per-row counts and sparse gradients would be
of this rank's rows only (``padding_idx`` it honours)."""


def _vocab_blocker(analysis: Analysis, placements: dict[str, Placement], tp: int) -> str | None:
    """Why the vocabulary cannot be split exactly (an option the split lookup cannot honour, an op writing
    to the table, a size the split reaches that tp does not divide), or None."""
    for e in analysis.vocab.embeddings:
        node = analysis.nodes[e]
        for index, name in _UNSPLITTABLE_EMBEDDING.items():
            if arg_or_default(node, index, name, False):
                return f"{analysis.layer(e)} uses {name}=True, which a vocabulary split cannot honour"
    prop = analysis.propagate_placements(_named(analysis, placements), tp)
    if prop.refusals:
        node, why = prop.refusals[0]
        return f"{why} (at {analysis.module(node) or node}; e.g. an embedding's max_norm renormalises its rows)"
    if prop.violations:
        # the split vocabulary reaches a size tp does not divide (logits of 9 codebooks viewed as [9, vocab]: each
        # rank's rows would end inside a codebook), which no rewrite can keep exact
        v = prop.violations[0]
        split = ", ".join(sorted(analysis.layer(o) for o in v.origins)) or "the vocabulary"
        return (f"the vocabulary split of {split} reaches {v.what} at {analysis.module(v.node) or v.node}, of size "
                f"{v.size}, which tp={tp} does not divide")
    return None


def _named(analysis: Analysis, by_target: Mapping[str, Placement]) -> dict[str, Placement]:
    """Placements keyed by ``get_attr`` target (as the planner builds them) keyed by original name instead."""
    return {analysis.captured.param_name(t): p for t, p in by_target.items()}
