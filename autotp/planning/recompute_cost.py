"""What activation recompute trades, priced with the planner's own cost model (``passes.costs``), for a layout
search to weigh: activation bytes no longer kept against forward FLOPs run again in backward.

``Recompute.BLOCKS`` (``rewrite.recompute``) runs every unit between cut candidates but the last under
checkpoint: a unit then keeps only its input, the hidden state at the cut before it, which is the previous
unit's output; so each recomputed unit saves its activations less its output, and costs its forward once more.
The pipeline schedules trade no memory or FLOPs per microbatch (they reorder the same work), so they need no
hook here; their bubbles are ``bench.pipeline.ideal_bubble``'s.
"""

from __future__ import annotations

from dataclasses import dataclass

from autotp.options import Recompute
from autotp.passes.costs import tensor_bytes
from autotp.passes.placement import Shard
from autotp.planning.planner import cost_sizes
from autotp.planning.stage_split import Units, build_units


@dataclass(frozen=True)
class RecomputeCost:
    """Per step (the whole batch) and per tensor-parallel rank, at the sizes it was priced at."""

    saved_bytes: float
    """Activation bytes backward no longer finds kept (the peak of one microbatch in flight is this over the
    microbatches; a pipeline stage's share is its units')."""
    extra_flops: float
    """Forward FLOPs run again in backward."""


def saved_per_unit(units: Units, outputs: list[float]) -> list[float]:
    """Activation bytes each of ``units`` no longer keeps under ``Recompute.BLOCKS``: its activations less its
    output (``outputs``: the hidden state at each cut, in bytes); the last unit (the head) is kept, 0. Pure."""
    return [max(0.0, units.activations[k] - outputs[k]) for k in range(len(units.compute) - 1)] + [0.0]


def units_cost(units: Units, outputs: list[float], recompute: Recompute) -> RecomputeCost:
    """The trade for ``units`` (from ``stage_split.build_units``) whose outputs (hidden states at each cut, in
    bytes) are ``outputs``; pure."""
    if recompute is Recompute.NONE:
        return RecomputeCost(0.0, 0.0)
    recomputed = range(len(units.compute) - 1)  # the last unit (the head) is kept
    return RecomputeCost(saved_bytes=sum(saved_per_unit(units, outputs)),
                         extra_flops=sum(units.compute[k] for k in recomputed))


def cut_outputs(analysis, prop, tp: int, units: Units, sizes: dict[str, int]) -> list[float]:
    """Bytes per tensor-parallel rank of the hidden state at each of ``units``' cuts (split ones divided by tp)."""
    nodes = {n.name: n for n in analysis.graph.nodes}
    split = {t for t, lay in prop.layouts.items() if isinstance(lay, Shard)}
    return [tensor_bytes(nodes[c.value], sizes) / (tp if c.value in split else 1) for c in units.cuts]


def recompute_cost(analysis, prop, tp: int, sizes: dict[str, int], recompute: Recompute) -> RecomputeCost:
    """The trade of ``recompute`` for the capture ``analysis`` split as ``prop`` (a propagation of a plan's
    placements) over ``tp`` ranks, at ``sizes`` (size symbol -> value, as ``planner.cost_sizes`` gives)."""
    units = build_units(analysis, prop, tp, sizes)
    return units_cost(units, cut_outputs(analysis, prop, tp, units, sizes), recompute)


def plan_recompute_cost(captured, plan, recompute: Recompute = Recompute.BLOCKS) -> RecomputeCost:
    """``recompute_cost`` of a plan for the ``captured`` model, at the plan's batch and sequence."""
    sizes = cost_sizes(captured, plan.batch or None, plan.seq or None)
    prop = captured.analysis.propagate_placements(dict(plan.placements), plan.tp, plan.sequence_parallel)
    return recompute_cost(captured.analysis, prop, plan.tp, sizes, recompute)
