"""Gradient clipping across every axis: the norm the unsharded model's gradients have, each element once.

A rank holds pieces of the model's gradients: a tp shard of a split parameter, a copy of a replicated one
(the same on every tp rank), an FSDP shard or a whole replica over dp, one of the copies of a weight tied
across pipeline stages. Each rank adds up only the pieces it *counts* (``is_counted``), so that one sum
over all ranks meets every element of the unsharded gradients exactly once.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from autotp.errors import InputError


def is_counted(split: bool, tp_rank: int, dp_counts: bool, first_holder: bool) -> bool:
    """Whether this rank's piece of a parameter's gradient enters the global norm: every tp rank's shard of a
    split parameter, a tp-replicated one on tp rank 0 only; ``dp_counts`` (each FSDP shard, or the first
    replica's whole copy); a weight tied across pipeline stages on its first holder only."""
    return (split or tp_rank == 0) and dp_counts and first_holder


def _check(max_norm, norm_type) -> float:
    for name, value in (("max_norm", max_norm), ("norm_type", norm_type)):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise InputError(f"{name} must be a number, got {value!r}")
    if not (norm_type == math.inf or norm_type > 0):
        raise InputError(f"norm_type must be positive (2.0 for the Euclidean norm) or math.inf, got {norm_type!r}")
    return float(norm_type)


def clip_grad_norm_(pieces: list[tuple[torch.Tensor, bool]], max_norm: float, norm_type: float = 2.0,
                    group=None, distributed: bool = True) -> torch.Tensor:
    """Scale every gradient in ``pieces`` (local tensors, ``(grad, counted)``) so that the global norm is at most
    ``max_norm``; returns the global norm before clipping, as ``torch.nn.utils.clip_grad_norm_`` does.

    A collective over ``group`` (None: the default group) unless ``distributed`` is False.
    """
    p = _check(max_norm, norm_type)
    counted = [g.detach() for g, c in pieces if c]
    device = pieces[0][0].device if pieces else torch.device("cpu")
    if p == math.inf:
        maxima = [g.abs().max().float() for g in counted if g.numel()]  # an FSDP shard may be empty
        total = torch.stack(maxima).max() if maxima else torch.zeros((), device=device)
        if distributed:
            dist.all_reduce(total, op=dist.ReduceOp.MAX, group=group)
    else:
        total = sum((g.float().abs().pow(p).sum() for g in counted), torch.zeros((), device=device))
        if distributed:
            dist.all_reduce(total, group=group)
        total = total.pow(1.0 / p)
    # torch's formula: multiply by min(1, max_norm / (norm + 1e-6)) always, with no branch on the value.
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for grad, _ in pieces:
        grad.detach().mul_(coef.to(grad.dtype))
    return total
