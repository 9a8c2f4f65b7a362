"""Where a rank sits among the expert-parallel ranks, as Megatron's expert-model-parallel group places it: the
``ep`` ranks of a group are consecutive in the (dp × tp) plane of a pipeline stage (tensor-parallel ranks
innermost), so a group holds whole tensor-parallel groups when ``tp`` divides ``ep``. Each rank of a group holds
``E/ep`` consecutive experts of every split bank (``ep_rank`` says which); the ranks holding the same experts in
the other groups (its *replicas*) sum their gradients, the gradient of the rows each group routed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from autotp.errors import InputError
from autotp.passes.grouped_banks import expert_placements
from autotp.options import DataParallelMode, Options
from autotp.rewrite.comm import TorchComm


def expert_rank(dp_rank: int, tp_rank: int, tp: int, ep: int) -> int:
    """This rank's place in its expert-parallel group (which ``E/ep`` experts it holds)."""
    return (dp_rank * tp + tp_rank) % ep


def group_members(pp_rank: int, dp: int, tp: int, ep: int) -> tuple[list[list[int]], list[list[int]]]:
    """Global ranks of a pipeline stage's expert-parallel groups and of its replica groups (the ranks holding the
    same experts), each in order."""
    base = pp_rank * dp * tp
    plane = range(dp * tp)
    groups = [[base + i for i in plane if i // ep == g] for g in range(dp * tp // ep)]
    replicas = [[base + i for i in plane if i % ep == r] for r in range(ep)]
    return groups, replicas


@dataclass
class ExpertGroups:
    """This rank's expert-parallel communicator and its replicas' process group."""

    comm: TorchComm
    """The expert-parallel group (dispatch and combine)."""
    replicas: object
    """The process group of the ranks holding this rank's experts (their gradients summed over it)."""
    replica_count: int
    rank: int
    """This rank's place in its expert-parallel group."""


def check_ep_layout(options: Options) -> None:
    """Refuse what the dispatch over data-parallel ranks cannot do exactly: under fsdp the experts (which FSDP
    leaves whole on their rank, as its replicas hold other experts) would keep fp32 weights where a mixed-precision
    policy casts the rest."""
    if options.ep > options.tp and options.dp_mode is DataParallelMode.FSDP and options.mixed_precision is not None:
        raise InputError(f"ep={options.ep} above tp={options.tp} under dp_mode='fsdp' with mixed_precision is not "
                         "supported yet: FSDP leaves the experts whole on their ranks, outside its mixed-precision "
                         "policy; pass dp_mode='replicate', drop mixed_precision, or use ep=tp")


def expert_groups(options: Options, pp_rank: int, dp_rank: int, tp_rank: int) -> ExpertGroups:
    """Make every expert-parallel and replica group of the world (each rank makes them all, in one order, as
    ``new_group`` requires) and return this rank's."""
    check_ep_layout(options)
    mine = pp_rank * options.dp * options.tp + dp_rank * options.tp + tp_rank
    comm, replicas, count = None, None, 1
    for stage in range(options.pp):
        groups, replica_sets = group_members(stage, options.dp, options.tp, options.ep)
        for members in groups:
            group = dist.new_group(members)
            if mine in members:
                comm = TorchComm(group)
        for members in replica_sets:
            group = dist.new_group(members)
            if mine in members:
                replicas, count = group, len(members)
    return ExpertGroups(comm, replicas, count, expert_rank(dp_rank, tp_rank, options.tp, options.ep))


def expert_ranks(options: Options, dp_rank: int, tp_rank: int, pp_rank: int = 0) -> ExpertGroups | None:
    """This rank's expert-parallel groups when they are not the tensor-parallel ones (``ep`` above ``tp``); None
    at ``ep = tp`` or ``ep = 1``, where the tp group dispatches and the data-parallel replicas hold the same experts,
    as they hold the same tensor-parallel shards."""
    if options.ep in (1, options.tp):
        return None
    return expert_groups(options, pp_rank, dp_rank, tp_rank)


def reduce_experts_over_replicas(dp, groups: ExpertGroups, modules, plan) -> None:
    """Have ``dp`` (a ``runtime.data_parallel.DataParallel``) sum the gradients of the experts the graphs of
    ``modules`` (pairs of a GraphModule, or a pipeline stage's, and its capture) hold over their replicas only."""
    held = [(dict(gm.named_parameters()), captured) for gm, captured in modules]
    # a pipeline stage's graph holds only its own layers' banks
    ids = {id(params[t]) for params, captured in held for t in expert_placements(captured, plan) if t in params}
    dp.hold_experts(ids, groups.replicas, groups.replica_count)
