"""The one-process checker at ``ep`` above ``tp``: every rank of ``dp`` replicas of ``tp`` ranks simulated by threads,
the experts spread over expert-parallel groups of ``ep`` consecutive ranks (tensor-parallel ranks innermost, as
``runtime.expert_groups`` places them), the routed rows dispatched and combined by the threads' all-to-alls.

Every replica runs the checker's one example, so every output and loss must be the unsharded model's, and every
replica's dense gradients too. An expert's gradient sums the rows every replica of its group routed to it; the
runtime then sums it over the replicas holding the same expert and averages over dp, as it averages every other
gradient, so the full gradient of a bank is its groups' (each gathered in ep-rank order) summed and divided by dp.
"""

from __future__ import annotations

import torch
from torch import fx

from autotp.capture import Captured
from autotp.passes.placement import PlacementKind
from autotp.planning import Plan
from autotp.rewrite.comm import ThreadComm
from autotp.rewrite.rank_graph import build_graph, materialise_all
from autotp.rewrite.streams import RankStream


def above_tp(plan: Plan) -> bool:
    """Whether ``plan`` spreads experts over data-parallel replicas too (``ep`` above ``tp``)."""
    return plan.options.ep > plan.tp and any(p.kind is PlacementKind.EXPERT for p in plan.placements.values())


def expert_ranks(captured: Captured, plan: Plan, seed: int) -> tuple[list[fx.GraphModule], list[ThreadComm]]:
    """Every rank's module of ``dp`` replicas (``plan.options.dp``) of ``tp`` ranks, in (dp, tp) order, with its
    tensor-parallel communicator; the experts dispatched over ep groups of threads."""
    tp, dp, ep = plan.tp, plan.options.dp, plan.options.ep
    tp_comms = [ThreadComm.group(tp) for _ in range(dp)]
    ep_comms = [ThreadComm.group(ep) for _ in range(dp * tp // ep)]
    modules, comms = [], []
    for d in range(dp):
        for t in range(tp):
            place = d * tp + t
            comm = tp_comms[d][t]
            gm = build_graph(captured, plan, t, comm if tp > 1 else None, stream=RankStream(seed),
                             ep_comm=ep_comms[place // ep][place % ep])
            materialise_all([(gm, captured)], plan, t, expert_rank=place % ep)
            modules.append(gm)
            comms.append(comm)
    return modules, comms


def expert_names(plan: Plan) -> set[str]:
    """The parameters ``plan`` splits by their experts."""
    return {n for n, p in plan.placements.items() if p.kind is PlacementKind.EXPERT}


def full_experts(plan: Plan, per_rank: list[dict[str, torch.Tensor]], name: str) -> torch.Tensor:
    """The full bank ``name`` from every rank's part (``per_rank``, in (dp, tp) order; each a tensor, or a
    gradient): each ep group's parts laid end to end, summed over the groups and divided by dp, as the runtime
    reduces an expert's gradient (each group's bank is whole; every group's holds the same experts)."""
    ep, dp = plan.options.ep, plan.options.dp
    groups = [torch.cat([rank[name] for rank in per_rank[g:g + ep]]) for g in range(0, len(per_rank), ep)]
    return sum(groups) / dp


def compare_experts(compare, plan: Plan, captured: Captured, reference, ranks, lr: float) -> None:
    """Every bank split by its experts: its gradient and its value after an SGD step of ``lr``, against the unsharded
    model's (``compare(what, where, got, want)``)."""
    per_rank = [{captured.aliases.get(captured.param_name(k), k): p for k, p in r.module.named_parameters()}
                for r in ranks]
    ref_params = dict(reference.named_parameters())
    for name in sorted(expert_names(plan) & set(per_rank[0])):
        grads = [{name: r[name].grad if r[name].grad is not None else torch.zeros_like(r[name])} for r in per_rank]
        want = ref_params[name].grad if ref_params[name].grad is not None else torch.zeros_like(ref_params[name])
        grad = full_experts(plan, grads, name)
        if compare("gradient", name, grad, want):
            # every group holds the same start values: one group's bank, stepped by the reduced gradient
            start = torch.cat([r[name].detach() for r in per_rank[:plan.options.ep]])
            compare("parameter after a step", name, start - lr * grad, ref_params[name].detach() - lr * want)
