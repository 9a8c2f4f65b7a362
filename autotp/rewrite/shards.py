"""Slicing a full tensor into one rank's shard and assembling shards back (segment-aware).

A split with ``segments`` (the global sizes of the parts along ``dim``) gives rank r chunk r of
every part: for a fused QKV weight, its share of Q, of K and of V, side by side.
"""

from __future__ import annotations

import torch

from autotp.passes.layout import Shard


def local_shard(full: torch.Tensor, dim: int, segments: tuple[int, ...], rank: int, tp: int) -> torch.Tensor:
    """Rank ``rank``'s shard of ``full`` along ``dim``."""
    parts = full.split(list(segments), dim=dim)
    return torch.cat([p.narrow(dim, rank * (p.shape[dim] // tp), p.shape[dim] // tp) for p in parts], dim=dim)


def assemble(shards: list[torch.Tensor], dim: int, segments: tuple[int, ...]) -> torch.Tensor:
    """The full tensor from every rank's shard (in rank order); inverse of ``local_shard``."""
    tp = len(shards)
    local = [s // tp for s in segments]
    pieces = [shard.split(local, dim=dim) for shard in shards]
    return torch.cat([pieces[r][i] for i in range(len(segments)) for r in range(tp)], dim=dim)


def local_blocks(full: torch.Tensor, dim: int, segments: tuple[int, ...], rank: int, tp: int) -> torch.Tensor:
    """``local_shard`` of every block of ``dim`` (consecutive runs of ``segments``: heads folded into the batch)."""
    blocks = full.unflatten(dim, (-1, sum(segments)))
    return local_shard(blocks, dim + 1, segments, rank, tp).flatten(dim, dim + 1)


def assemble_blocks(shards: list[torch.Tensor], dim: int, segments: tuple[int, ...]) -> torch.Tensor:
    """The full tensor from every rank's ``local_blocks``; inverse of it."""
    local = sum(segments) // len(shards)
    parts = [s.unflatten(dim, (-1, local)) for s in shards]
    return assemble(parts, dim + 1, segments).flatten(dim, dim + 1)


def local_part(full: torch.Tensor, shard: Shard, rank: int, tp: int) -> torch.Tensor:
    """Rank ``rank``'s part of a full value laid out as ``shard`` (repeated over blocks or not)."""
    slicer = local_blocks if shard.blocks != 1 else local_shard
    return slicer(full, shard.dim, shard.segments, rank, tp)


def segments_or_whole(segments: tuple[int, ...], size: int) -> tuple[int, ...]:
    """``segments``, or the whole dim as one segment when the split is plain."""
    return tuple(segments) if segments else (size,)
