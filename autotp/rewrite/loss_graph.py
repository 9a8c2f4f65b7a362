"""A rank's graph of the model and a user's loss function together (``capture.with_loss``), reading a parallel
module's own tensors: the plan's splits propagate into the loss, so a cross-entropy of vocabulary-split logits
runs as the vocab-parallel cross-entropy instead of on gathered logits. The rewrite step of
``runtime.loss.LossGraphs``, where the loss is owned."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import fx, nn

from autotp.capture.core.with_loss import capture_with_loss
from autotp.errors import CaptureError, PlanError
from autotp.planning.plan import Plan
from autotp.rewrite.cache_layout import share_tensors, unheld_tensors
from autotp.rewrite.comm import Communicator
from autotp.rewrite.rank_graph import build_graph
from autotp.rewrite.streams import RankStream


def build_loss_graph(model: nn.Module, plan: Plan, rank: int, comm: Communicator | None, stream: RankStream | None,
                     tensors: dict[str, torch.Tensor], call: tuple, loss_fn: Callable, training: bool) -> fx.GraphModule:
    """This rank's graph of ``loss_fn(model(inputs), target)``, taking the model's flat inputs then the target, its
    attributes ``tensors`` (the parallel module's, by original name). ``call`` is (input names, flat inputs,
    target): an example to capture on. Raises ``CaptureError`` when it cannot be captured and ``PlanError`` when
    the plan's splits do not reach through the loss exactly (a size the split must divide does not)."""
    names, flat, target = call
    captured = capture_with_loss(model, names, flat, target, loss_fn, training)
    if plan.tp > 1:
        prop = captured.analysis.propagate_placements(plan.placements, plan.tp, plan.sequence_parallel)
        if prop.violations or prop.refusals:
            what = prop.violations[0].what if prop.violations else prop.refusals[0][1]
            raise PlanError(f"the plan's splits do not carry through the loss function ({what})")
    gm = build_graph(captured, plan, rank, comm, stream=stream)
    unheld = unheld_tensors(gm, captured, tensors)
    if unheld:
        # Captured with the loss, a tensor the model reads twice (a tied head) can come out as a constant of the
        # graph: it would train a stale copy, so this loss runs on gathered outputs instead (the caller warns).
        raise CaptureError(f"the model with its loss function reads {', '.join(unheld)} as constants of the graph, "
                           "not as the parallel module's tensors")
    share_tensors(gm, captured, tensors, what="the model with its loss function")
    return gm
