"""What a rank holds of a tensor, in one place: the three views of a split, and the tensors in and out.

- ``Placement``: how one *parameter* is laid out (its ``PlacementKind``, the split storage ``dim``, fused
  ``segments``, ``replicas``): what a ``Plan`` records, keyed by name.
- ``Shard``: how any *value* in the graph is split (the same dim/segments/replicas, and possibly repeated over
  ``blocks``): what propagation computes; ``Placement.layout`` gives a parameter's.
- ``Part``: the global runs one *rank* holds (offsets and lengths): what weight sources read and sharded
  checkpoints record; ``Placement.part`` gives it.

Along the split dim each segment is cut into ``tp // replicas`` contiguous chunks and rank r holds chunk
``r // replicas`` of every segment: for a fused QKV weight, its share of Q, of K and of V, side by side. The
chunks are equal when their count divides the segment; otherwise the first ones are one longer
(``chunk_span``, as ``torch.tensor_split`` cuts): a vocabulary tp does not divide, which Megatron pads instead.
``local_shard`` takes a rank's slice of a full tensor and ``full_tensor`` puts every rank's back together;
every layer (the rewriter, the runtime, the checker, the tests) calls these and no other. A rank's tensors
come from a ``Source`` asked for ``Want``s (a tensor and the ``Part`` the rank holds of it).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

import torch


@dataclass(frozen=True)
class Shard:
    """Sharded along ``dim``; ``segments`` are the global sizes of the independently split parts.

    ``blocks`` (1, or a symbolic size such as the batch) says the dim holds that many consecutive
    copies of the segments, each split alike: heads folded into the batch (``[B*H, T, d]``, as
    ``nn.MultiheadAttention`` lays them out) are ``Shard(0, (H,), blocks=B)``.
    """

    dim: int
    segments: tuple[int, ...]
    blocks: object = 1
    replicas: int = 1
    """Ranks holding each chunk: tp // replicas chunks per segment, rank r holding chunk r // replicas (the KV
    heads of grouped-query attention when tp exceeds them). In the forward the ranks sharing a chunk hold the
    same values; their gradients are each rank's share, summed where they meet whole values or parameters."""
    spread: bool = False
    """With ``replicas``: the dim after ``dim`` is split among the ranks sharing a chunk (rank r holding chunk
    r % replicas of it), as a KV head expanded over its query heads is, just before they are merged into one."""

    @property
    def size(self) -> int:
        """Global size along ``dim`` of one block."""
        return sum(self.segments)

    def chunks(self, tp: int) -> int:
        """How many chunks each segment is cut into over ``tp`` ranks."""
        return tp // self.replicas

    def moved(self, dim: int) -> Shard:
        """The same split on another dimension index."""
        return dataclasses.replace(self, dim=dim)


def same_split(a, b) -> bool:
    """Whether two layouts hold the same slice on every rank: equal, or one's blocks written as the other's
    segments (``Shard(1, (2,), blocks=2)``, K/V heads repeated per block, and ``Shard(1, (2, 2))``)."""
    if a == b:
        return True
    if not (isinstance(a, Shard) and isinstance(b, Shard)):
        return False
    if (a.dim, a.replicas, a.spread) != (b.dim, b.replicas, b.spread):
        return False
    blocks = [int(x.blocks) if isinstance(x.blocks, int) or getattr(x.blocks, "is_Integer", False) else None
              for x in (a, b)]  # a count of blocks may be a sympy integer
    return None not in blocks and a.segments * blocks[0] == b.segments * blocks[1]


class PlacementKind(str, Enum):
    """How one parameter is laid out across the tensor-parallel ranks (the one vocabulary of split kinds)."""

    COLWISE = "colwise"
    """Split along the layer's output features (Megatron's column-parallel linear)."""
    ROWWISE = "rowwise"
    """Split along the layer's input features (Megatron's row-parallel linear)."""
    VOCAB = "vocab"
    """Split along the vocabulary (embedding rows, or the LM head's output rows)."""
    REPLICATED = "replicated"
    """A full copy on every rank."""
    EXPERT = "expert"
    """Split along a bank's experts (dim 0): each rank holds whole experts (expert parallelism). The values the
    experts compute are not split by it: each rank computes its experts' rows, summed over the ranks."""

    @property
    def word(self) -> str:
        """The word tables and pictures use: column, row, vocab, replicated."""
        return _WORDS[self]


_WORDS = {PlacementKind.COLWISE: "column", PlacementKind.ROWWISE: "row", PlacementKind.VOCAB: "vocab",
          PlacementKind.REPLICATED: "replicated", PlacementKind.EXPERT: "expert"}

Layout = Shard | None | tuple  # tuple: one layout per output of a multi-output op


@dataclass(frozen=True)
class Placement:
    """One parameter's placement: ``kind``, the split storage ``dim``, and fused ``segments``.

    ``segments`` is empty for a plain split. A fused projection (say one weight holding Q, K and V)
    lists the global sizes of its parts along ``dim``: each part is split across the ranks on its
    own, so every rank holds its share of Q, of K and of V.
    """

    kind: PlacementKind
    dim: int | None = None
    segments: tuple[int, ...] = ()
    replicas: int = 1
    """Ranks holding each chunk: tp // replicas chunks, rank r holding chunk r // replicas (the K/V projections of
    grouped-query attention when tp exceeds the KV heads: each rank keeps the KV head its query heads use)."""

    def __post_init__(self):
        object.__setattr__(self, "kind", PlacementKind(self.kind))
        object.__setattr__(self, "segments", tuple(_whole("segments", s, 1) for s in self.segments))
        if self.dim is not None:
            object.__setattr__(self, "dim", _whole("dim", self.dim, 0))
        if (self.kind is PlacementKind.REPLICATED) != (self.dim is None):
            raise ValueError(f"placement {self.kind.value!r} needs dim set iff it is split, got dim={self.dim}")
        if not isinstance(self.replicas, int) or self.replicas < 1:
            raise ValueError(f"replicas must be a positive integer, got {self.replicas!r}")

    def __repr__(self) -> str:
        if self.kind is PlacementKind.REPLICATED:
            return "replicated"
        seg = f", segments={list(self.segments)}" if self.segments else ""
        shared = f", replicas={self.replicas}" if self.replicas != 1 else ""
        return f"{self.kind.value}(dim={self.dim}{seg}{shared})"

    def chunks(self, tp: int) -> int:
        """How many chunks each segment is cut into over ``tp`` ranks."""
        return tp // self.replicas

    @property
    def is_split(self) -> bool:
        """Whether each rank holds only a slice of this parameter."""
        return self.kind is not PlacementKind.REPLICATED

    def layout(self, size: int) -> Shard:
        """The layout propagation gives the parameter (``size``: its size along ``dim``)."""
        return Shard(self.dim, self.segments or (size,), replicas=self.replicas)

    def part(self, shape: tuple[int, ...], rank: int, tp: int) -> Part:
        """Rank ``rank``'s part of a tensor of ``shape`` placed like this (the runs ``local_shard`` takes)."""
        shape = tuple(int(s) for s in shape)
        if not self.is_split or tp == 1:
            return Part(shape)
        runs, base = [], 0
        chunks, chunk = self.chunks(tp), rank // self.replicas
        for segment in segments_or_whole(self.segments, shape[self.dim]):
            start, length = chunk_span(segment, chunks, chunk)
            runs.append((base + start, length))
            base += segment
        return Part(shape, self.dim, tuple(runs))

    def to_dict(self) -> dict:
        """A JSON-ready dict."""
        shared = {"replicas": self.replicas} if self.replicas != 1 else {}
        return {"kind": self.kind.value, "dim": self.dim, "segments": list(self.segments)} | shared


def _whole(field: str, value, least: int) -> int:
    """``value`` as an int (sympy and numpy integers are ints too; floats, strings and bools are not): a plan file's
    ``dim: 0.0`` or ``"0"`` is refused, not truncated."""
    if isinstance(value, bool) or not hasattr(value, "__index__") or int(value) < least:
        raise ValueError(f"placement {field} must hold whole numbers of at least {least}, got {value!r}")
    return int(value)


REPLICATED = Placement(PlacementKind.REPLICATED)


def part_of(placement: Placement | None, shape: tuple[int, ...], rank: int, tp: int) -> Part:
    """Rank ``rank``'s part of a tensor of ``shape`` placed as ``placement`` (None: replicated)."""
    return (placement or REPLICATED).part(shape, rank, tp)


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


def chunk_span(size: int, chunks: int, chunk: int) -> tuple[int, int]:
    """(start, length) of chunk ``chunk`` of ``size`` cut into ``chunks`` contiguous chunks: equal ones when
    ``chunks`` divides ``size``, else the first ``size % chunks`` one longer (``torch.tensor_split``'s cut). Only
    a vocabulary split is ever uneven (propagation refuses every other size tp does not divide)."""
    base, extra = divmod(size, chunks)
    return chunk * base + min(chunk, extra), base + (chunk < extra)


def chunk_lengths(segments: tuple[int, ...], chunks: int) -> list[int]:
    """Each chunk's length along the split dim (its part of every segment), in chunk order."""
    return [sum(chunk_span(s, chunks, c)[1] for s in segments) for c in range(chunks)]


def local_shape(shape: tuple[int, ...], shard: Shard | None, tp: int) -> tuple[int, ...]:
    """A rank's shape of a whole ``shape`` split evenly as ``shard`` (None: whole): a split state (a KV cache's
    heads), which is never the unevenly split vocabulary."""
    if shard is None:
        return tuple(shape)
    out = list(shape)
    out[shard.dim] = sum(s // shard.chunks(tp) for s in shard.segments)
    return tuple(out)


def segments_or_whole(segments: tuple[int, ...], size: int) -> tuple[int, ...]:
    """``segments``, or the whole dim as one segment when the split is plain."""
    return tuple(segments) if segments else (size,)


def local_shard(full: torch.Tensor, dim: int, segments: tuple[int, ...], rank: int, tp: int) -> torch.Tensor:
    """Rank ``rank``'s shard of ``full`` along ``dim`` (``segments`` empty: one segment, the whole dim, which the
    caller has checked ``tp`` divides)."""
    parts = full.split(list(segments_or_whole(segments, full.shape[dim])), dim=dim)
    return torch.cat([p.narrow(dim, *chunk_span(p.shape[dim], tp, rank)) for p in parts], dim=dim)


def assemble(shards: list[torch.Tensor], dim: int, segments: tuple[int, ...]) -> torch.Tensor:
    """The full tensor from every chunk's shard (in chunk order); inverse of ``local_shard``."""
    tp = len(shards)
    if not segments:
        return torch.cat(shards, dim=dim)
    pieces = [shard.split([chunk_span(s, tp, r)[1] for s in segments], dim=dim) for r, shard in enumerate(shards)]
    return torch.cat([pieces[r][i] for i in range(len(segments)) for r in range(tp)], dim=dim)


def local_blocks(full: torch.Tensor, dim: int, segments: tuple[int, ...], rank: int, tp: int) -> torch.Tensor:
    """``local_shard`` of every block of ``dim`` (consecutive runs of ``segments``: heads folded into the batch)."""
    blocks = full.unflatten(dim, (-1, sum(segments)))
    return local_shard(blocks, dim + 1, segments, rank, tp).flatten(dim, dim + 1)


def assemble_blocks(shards: list[torch.Tensor], dim: int, segments: tuple[int, ...]) -> torch.Tensor:
    """The full tensor from every rank's ``local_blocks``; inverse of it."""
    lengths = chunk_lengths(segments, len(shards))
    parts = [s.unflatten(dim, (-1, length)) for s, length in zip(shards, lengths)]
    return assemble(parts, dim + 1, segments).flatten(dim, dim + 1)


def full_tensor(placement: Placement | None, shards: list[torch.Tensor]) -> torch.Tensor:
    """The full tensor from every tensor-parallel rank's tensor (in rank order), placed as ``placement``
    (None or replicated: every rank holds it whole, the first copy is returned). Of a chunk several ranks hold
    (``replicas``), the first holder's copy is taken."""
    if placement is None or not placement.is_split or len(shards) == 1:
        return shards[0]
    chunks = shards[::placement.replicas]
    size = sum(c.shape[placement.dim] for c in chunks)
    return assemble(chunks, placement.dim, segments_or_whole(placement.segments, size))


@dataclass(frozen=True)
class Want:
    """One tensor a rank's module needs: the model's tensor (possibly on the meta device) under its first name,
    and the part of it this rank holds."""

    name: str
    tensor: torch.Tensor
    part: Part


Source = Callable[[list[Want]], list[torch.Tensor]]
"""Gives the rank's tensor (a new one, of ``want.part.local_shape``) for every want, in order: the model's own
tensors (``own_tensors``), the first rank's copy (``runtime.process.from_first_rank``) or a checkpoint's slices
(``runtime.readers``). Asked once for everything a set of modules needs, so a source can batch its reads."""


def own_tensors(wants: list[Want]) -> list[torch.Tensor]:
    """The default source: each rank's part cut from the model's own tensors."""
    return [w.part.take(w.tensor.detach()) for w in wants]
