"""The two entry points: ``plan`` (no process group needed) and ``parallelize``."""

from __future__ import annotations

import torch.distributed as dist
from torch import nn

from autotp.capture import Captured, capture
from autotp.errors import InputError, PlanError
from autotp.plan import Plan
from autotp.planner import make_plan
from autotp.rewrite import rewrite
from autotp.runtime import ParallelModule, check_same_plan, check_world, device_for, ensure_process_group


def _check_tp(tp) -> int:
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise InputError(f"tp must be a positive integer (the number of tensor-parallel ranks), got {tp!r}")
    return tp


def _check_plan(plan: Plan, captured: Captured, tp: int) -> Plan:
    """A user-supplied plan must be for this tp and name only parameters this model has."""
    if not isinstance(plan, Plan):
        raise InputError(f"plan must be an autotp.Plan (e.g. Plan.from_json(text)), got {type(plan).__name__}")
    if plan.tp != tp:
        raise PlanError(f"the plan was made for tp={plan.tp} but tp={tp} was asked for; re-plan or pass tp={plan.tp}")
    known = set(captured.param_names)
    unknown = sorted(set(plan.placements) - known)
    if unknown:
        raise PlanError(f"the plan names parameters this model does not have: {', '.join(unknown[:5])}; "
                        "make the plan from this model (autotp.plan) or fix the names")
    return plan


def plan(model: nn.Module, tp: int, example_inputs) -> Plan:
    """The tensor-parallel plan for ``model`` at ``tp`` ranks, computed without any process group."""
    return make_plan(capture(model, example_inputs), _check_tp(tp))


def parallelize(model: nn.Module, tp: int, example_inputs, plan: Plan | None = None, group=None) -> ParallelModule:
    """This rank's tensor-parallel piece of ``model``; the model itself is left untouched.

    Uses ``group`` if given, else the default process group (initialised from torchrun's environment
    when needed). With ``plan`` given, applies it instead of planning.
    """
    tp = _check_tp(tp)
    group = group if group is not None else ensure_process_group(tp)
    check_world(group, tp)
    captured = capture(model, example_inputs)
    chosen = _check_plan(plan, captured, tp) if plan is not None else make_plan(captured, tp)
    check_same_plan(chosen, group)
    rank = dist.get_rank(group) if group is not None else 0
    gm = rewrite(captured, chosen, rank, group)
    device = device_for(group)
    if device is not None:
        gm.to(device)  # NCCL communicates GPU tensors; inputs must then be on this device too
    graph_state = {captured.param_name(k) for k in gm.state_dict()}
    extra = {k: v.detach().clone() for k, v in model.state_dict().items()
             if captured.aliases.get(k, k) not in graph_state}
    return ParallelModule(gm, chosen, group, rank, captured.state_keys, captured.aliases, captured.param_name, extra)
