"""Checks of a plan made elsewhere (a file, a hand edit) that propagation alone does not make.

A bias is added to its projection's output features, so it must be split as the weight's outputs are:
with a column-split weight (or a head split by the vocabulary), along the same features (same segments and
replicas); with a row-split or whole weight, not at all (a row split's bias is added once, after the
all-reduce). A plan whose bias disagrees with its weight ran into a shape error in the first forward; here it
is refused at plan-check time.
"""

from __future__ import annotations

from autotp.errors import PlanError
from autotp.passes.analysis import Analysis
from autotp.passes.placement import REPLICATED, Placement, PlacementKind


def check_biases_follow_weights(analysis: Analysis, placements: dict[str, Placement]) -> None:
    """``PlanError`` naming the first projection whose bias is not split as its weight's outputs are.

    ``placements`` is keyed by ``get_attr`` target, as the projections name their parameters.
    """
    name = analysis.captured.param_name
    for projection in analysis.projections.values():
        if not projection.bias:
            continue
        weight = placements.get(projection.weight, REPLICATED)
        bias = placements.get(projection.bias, REPLICATED)
        if weight.kind in (PlacementKind.COLWISE, PlacementKind.VOCAB):  # its outputs split (a head's vocabulary)
            wanted = Placement(weight.kind, 0, weight.segments, weight.replicas)
        else:
            wanted = REPLICATED
        if (bias.kind, bias.dim, bias.segments, bias.replicas) != (wanted.kind, wanted.dim, wanted.segments,
                                                                   wanted.replicas):
            raise PlanError(f"the plan splits {name(projection.weight)} {_said(weight)} but its bias "
                            f"{name(projection.bias)} {_said(bias)}: a bias is split as its weight's outputs are "
                            f"(here: {_said(wanted)}); set the bias to that, or re-plan with autotp.plan")


def _said(placement: Placement) -> str:
    if placement.kind is PlacementKind.REPLICATED:
        return "replicated"
    segments = f", segments {list(placement.segments)}" if placement.segments else ""
    return f"{placement.kind.value} (dim {placement.dim}{segments})"
