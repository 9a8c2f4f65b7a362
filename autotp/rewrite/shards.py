"""Slicing a full tensor into one rank's shard and assembling shards back (segment-aware); a rank's ``Part``.

A split with ``segments`` (the global sizes of the parts along ``dim``) gives rank r chunk r of
every part: for a fused QKV weight, its share of Q, of K and of V, side by side.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from autotp.errors import InputError, InternalError
from autotp.passes.layout import Shard, static
from autotp.planning.plan import Placement


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


def local_shard(full: torch.Tensor, dim: int, segments: tuple[int, ...], rank: int, tp: int) -> torch.Tensor:
    """Rank ``rank``'s shard of ``full`` along ``dim`` (``segments`` empty: one segment, the whole dim)."""
    if not segments:
        check_divides(full.shape[dim], tp, dim)
        segments = (full.shape[dim],)
    parts = full.split(list(segments), dim=dim)
    return torch.cat([p.narrow(dim, rank * (p.shape[dim] // tp), p.shape[dim] // tp) for p in parts], dim=dim)


def assemble(shards: list[torch.Tensor], dim: int, segments: tuple[int, ...]) -> torch.Tensor:
    """The full tensor from every rank's shard (in rank order); inverse of ``local_shard``."""
    tp = len(shards)
    if not segments:
        return torch.cat(shards, dim=dim)
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
    return slicer(full, shard.dim, runtime_segments(shard.segments), rank // shard.replicas, shard.chunks(tp))


def segments_or_whole(segments: tuple[int, ...], size: int) -> tuple[int, ...]:
    """``segments``, or the whole dim as one segment when the split is plain."""
    return tuple(segments) if segments else (size,)


@dataclass(frozen=True)
class Part:
    """The part of a tensor one rank holds: along ``dim``, the global ranges ``runs`` (start, length), side by
    side in the rank's tensor (a fused split holds one run per segment); ``dim`` None means the whole tensor.

    It is what a tensor source is asked for, and what a sharded checkpoint records per rank (each run is one
    chunk at global offsets), so a rank reads and writes exactly its slices and nothing else.
    """

    shape: tuple[int, ...]
    """The full tensor's shape."""
    dim: int | None = None
    runs: tuple[tuple[int, int], ...] = ()

    @property
    def whole(self) -> bool:
        """Whether the rank holds the full tensor."""
        return self.dim is None

    @property
    def local_shape(self) -> tuple[int, ...]:
        """The shape of the rank's tensor."""
        if self.whole:
            return self.shape
        return (*self.shape[:self.dim], sum(length for _, length in self.runs), *self.shape[self.dim + 1:])

    def chunks(self) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
        """(global offsets, sizes) of each run, in the order they sit in the rank's tensor."""
        if self.whole:
            return [((0,) * len(self.shape), self.shape)]
        out = []
        for start, length in self.runs:
            offsets = tuple(start if d == self.dim else 0 for d in range(len(self.shape)))
            out.append((offsets, tuple(length if d == self.dim else s for d, s in enumerate(self.shape))))
        return out

    def views(self, local: torch.Tensor) -> list[torch.Tensor]:
        """Views of the rank's tensor ``local``, one per chunk (writing them writes ``local``)."""
        if self.whole:
            return [local]
        out, at = [], 0
        for _, length in self.runs:
            out.append(local.narrow(self.dim, at, length))
            at += length
        return out

    def take(self, full: torch.Tensor) -> torch.Tensor:
        """The rank's tensor cut from the full one (a new tensor)."""
        if self.whole:
            return full.clone()
        return torch.cat([full.narrow(self.dim, start, length) for start, length in self.runs], dim=self.dim)


def part_of(placement: Placement | None, shape: tuple[int, ...], rank: int, tp: int) -> Part:
    """Rank ``rank``'s part of a tensor of ``shape`` placed as ``placement`` (the runs ``local_shard`` takes)."""
    shape = tuple(int(s) for s in shape)
    if placement is None or not placement.is_split or tp == 1:
        return Part(shape)
    runs, base = [], 0
    chunks, chunk = placement.chunks(tp), rank // placement.replicas
    for segment in segments_or_whole(placement.segments, shape[placement.dim]):
        share = segment // chunks
        runs.append((base + chunk * share, share))
        base += segment
    return Part(shape, placement.dim, tuple(runs))
