"""Split or whole where both are exact: what the cost model chooses, under a per-rank memory budget.

Regions (an attention, an MLP) are split unless a ``memory_budget`` is given: then every region whose split
costs more time than it saves is kept whole, the most time saved per byte first, while the rank's training
state still fits the budget (without a budget a region's weights are the memory tensor parallelism exists to
divide, so they are split).

Splitting the vocabulary (the token embedding and the LM head) divides their compute and memory by tp, and
costs communication every step: an all-reduce of the embedding's (B, T, D) output forward, one of the
head input's gradient backward, and the vocab-parallel loss's three numbers per token. For a small
vocabulary the communication costs more than the compute it saves (measured: bench.vocab_choice). Megatron
always splits; torchtitan and HF's ``tp_plan`` hard-code one choice too. Here the planner prices both with
a link's compute rate and collective cost (``machines.Link``), at the plan's batch and sequence, and keeps the
vocabulary whole only when that is faster and its whole tables (with their gradients and AdamW moments) still fit the
memory budget.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from autotp.passes.analysis import Analysis
from autotp.passes.costs import evaluate, node_cost
from autotp.passes.graph import sizes
from autotp.passes.region_match import RegionKind, RegionMatch
from autotp.planning.machines import Link

TRAINING_COPIES = 4
"""Bytes per parameter byte while training with AdamW: the parameter, its gradient and two moments."""


@dataclass(frozen=True)
class VocabCost:
    """What splitting the vocabulary saves and costs per training step, at the plan's batch and sequence."""

    saved: float
    """Seconds of compute per step the split saves on each rank (forward and backward of the heads)."""
    communication: float
    """Seconds of communication per step the split adds."""
    whole_bytes: int
    """Bytes per rank that keeping the tables whole adds while training (parameters, gradients, moments)."""

    @property
    def whole_is_faster(self) -> bool:
        """Whether one step is faster with the vocabulary whole."""
        return self.communication > self.saved


def vocab_cost(analysis: Analysis, tp: int, values: dict[str, int], link: Link) -> VocabCost:
    """Price the vocabulary split of ``analysis`` at ``tp`` with the size symbols set to ``values``."""
    vocab, saved, communication = analysis.vocab, 0.0, 0.0
    share = 1 - 1 / tp
    for head in vocab.heads:
        proj = analysis.projections[head]
        x = analysis.nodes[proj.input]
        tokens = evaluate(math.prod(sizes(x)[:-1]), values)
        itemsize = x.meta["val"].element_size()
        saved += link.compute(6 * tokens * proj.in_features * proj.out_features * share)  # forward + backward
        communication += link.all_reduce(tokens * proj.in_features * itemsize, tp)  # f before the head
        communication += link.all_gather(tokens * 3 * 4 * tp, tp)  # the loss's statistics
    for embedding in vocab.embeddings:
        out = analysis.nodes[embedding]
        communication += link.all_reduce(evaluate(math.prod(sizes(out)), values) * out.meta["val"].element_size(),
                                            tp)
    tables = {analysis.embeddings[e].weight for e in vocab.embeddings} | {
        analysis.projections[h].weight for h in vocab.heads}
    table_bytes = sum(_param_bytes(analysis, t) for t in tables)
    return VocabCost(saved, communication, int(table_bytes * share * TRAINING_COPIES))


def _param_bytes(analysis: Analysis, target: str) -> int:
    tensor = analysis.captured.module.get_parameter(target)
    return tensor.numel() * tensor.element_size()


def training_bytes_per_rank(analysis: Analysis, split: dict[str, object], tp: int) -> int:
    """Bytes one rank holds while training (AdamW) when the ``get_attr`` targets in ``split`` are split."""
    total = 0
    for target, tensor in analysis.captured.module.named_parameters(remove_duplicate=True):
        total += tensor.numel() * tensor.element_size() // (tp if target in split else 1)
    return total * TRAINING_COPIES


@dataclass(frozen=True)
class RegionCost:
    """What splitting one region saves and costs per training step (as ``VocabCost``)."""

    region: RegionMatch
    saved: float
    communication: float
    whole_bytes: int

    @property
    def gain(self) -> float:
        """Seconds per step keeping it whole saves (negative: the split is faster)."""
        return self.communication - self.saved


def region_cost(analysis: Analysis, region: RegionMatch, tp: int, values: dict[str, int],
                link: Link) -> RegionCost:
    """Price ``region``'s split: the forward and backward compute of its nodes divided by tp, against its
    two collectives (the closing all-reduce forward; the opening all-reduce, or a lone row's all-gather, of
    the input's gradient backward)."""
    share = 1 - 1 / tp
    flops = sum(evaluate(node_cost(analysis.nodes[n]).flops, values) for n in _region_nodes(analysis, region))
    row = analysis.nodes[region.rows[0]]
    x = analysis.nodes[analysis.projections[region.rows[0]].input]
    out_bytes = evaluate(math.prod(sizes(row)), values) * row.meta["val"].element_size()
    in_bytes = evaluate(math.prod(sizes(x)), values) * x.meta["val"].element_size()
    backward = (link.all_gather(in_bytes, tp) if region.kind is RegionKind.ROW
                else link.all_reduce(out_bytes, tp))
    params = {analysis.projections[n].weight for n in (*region.columns, *region.rows)}
    params |= {analysis.projections[n].bias for n in region.columns if analysis.projections[n].bias}
    params |= {t for t, _ in region.params}
    whole = sum(_param_bytes(analysis, t) for t in params) * share * TRAINING_COPIES
    return RegionCost(region, link.compute(3 * flops * share), link.all_reduce(out_bytes, tp) + backward,
                      int(whole))


def _region_nodes(analysis: Analysis, region: RegionMatch) -> list[str]:
    """The nodes a region's split divides: from its column projections to its rows (a lone row: itself)."""
    rows, seen, todo = set(region.rows), set(), list(region.columns)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        if name not in rows:
            todo.extend(u.name for u in analysis.nodes[name].users if u.op == "call_function")
    return sorted(seen | rows)


def regions_kept_whole(costs: list[RegionCost], split_bytes: int, budget: int | None) -> list[RegionCost]:
    """The regions to keep whole: with a budget, those whose split is slower, the most time saved per byte
    first, while the rank's training state fits ``budget`` (``split_bytes``: with every region split)."""
    if budget is None:
        return []
    kept, total = [], split_bytes
    for cost in sorted((c for c in costs if c.gain > 0), key=lambda c: c.gain / max(c.whole_bytes, 1), reverse=True):
        if total + cost.whole_bytes <= budget:
            kept.append(cost)
            total += cost.whole_bytes
    return kept


def vocab_verdict(cost: VocabCost, split_bytes: int, budget: int | None) -> tuple[bool, str]:
    """(whether to keep the vocabulary whole, why): whole when that is faster and fits ``budget``."""
    timing = (f"splitting it would save {cost.saved * 1e3:.3g} ms of compute per step and add "
              f"{cost.communication * 1e3:.3g} ms of communication")
    if not cost.whole_is_faster:
        return False, timing
    if budget is not None and split_bytes + cost.whole_bytes > budget:
        return False, (f"{timing}, but whole it would need {(split_bytes + cost.whole_bytes) / 2**20:.4g} MiB per "
                       f"rank for training, over the memory budget of {budget / 2**20:.4g} MiB")
    return True, timing
