"""Splits whose size is known only at run time (the sequence under sequence parallelism): checked against the
input, then sliced by ``passes.placement``, which owns every slice and reassembly."""

from __future__ import annotations

import torch

from autotp.errors import InputError, InternalError
from autotp.passes.placement import Shard, local_blocks, local_shard
from autotp.passes.reshapes import static


def runtime_segments(segments: tuple) -> tuple[int, ...]:
    """``segments`` as sizes torch takes, or ``()`` for a split of one symbolic size (the sequence under sequence
    parallelism), which the functions here size from the tensor they are given."""
    if all(static(s) is not None for s in segments):
        return tuple(int(s) for s in segments)
    if len(segments) > 1:
        raise InternalError(f"a split of several parts of dynamic sizes {list(segments)} reached the rewrite; "
                            "propagation keeps such values whole")
    return ()


def check_divides(size: int, tp: int, dim: int) -> None:
    """A split of a size known only at run time (the sequence) needs it to divide by tp: say so, as an input error."""
    if size % tp:
        raise InputError(f"sequence_parallel splits dim {dim} (the sequence) over tp={tp} ranks, but this input has "
                         f"{size} there; pad the sequence to a multiple of {tp} or plan without sequence_parallel")


def local_value(full: torch.Tensor, dim: int, segments: tuple[int, ...], rank: int, tp: int,
                blocked: bool = False) -> torch.Tensor:
    """Rank ``rank``'s slice of a value (``segments`` empty: the whole dim, sized now and checked to divide)."""
    if not segments:
        check_divides(full.shape[dim], tp, dim)
    return (local_blocks if blocked else local_shard)(full, dim, segments, rank, tp)


def local_part(full: torch.Tensor, shard: Shard, rank: int, tp: int) -> torch.Tensor:
    """Rank ``rank``'s part of a full value laid out as ``shard`` (repeated over blocks or not)."""
    return local_value(full, shard.dim, runtime_segments(shard.segments), rank // shard.replicas, shard.chunks(tp),
                       shard.blocks != 1)
