"""What the region search finds: a region's kind and the projections it splits (``region_search.find_regions`` finds
them; planning and the tools read them)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from autotp.passes.placement import Shard
from autotp.passes.propagation import Violation


class RegionKind(str, Enum):
    """What a block of layers sharded together is, told from the graph's structure."""

    ATTENTION = "attention"
    """Split outputs meet attention ops (SDPA, a softmax of QKᵀ)."""
    GATED_MLP = "gated_mlp"
    """Two split branches from different projections are multiplied (SwiGLU)."""
    MLP = "mlp"
    """Any other column→row region."""
    ROW = "row"
    """A lone projection between whole values, split by its input features: its input sliced (an all-gather of
    the gradient backward), its output all-reduced (Megatron's ``RowParallelLinear(input_is_parallel=False)``)."""
    CONVOLUTION = "convolution"
    """Convolutions split by channels (dim 1 of ``N, C, ...``): dense ones column- then row-split, the norms,
    grouped convolutions and pooling between them per channel."""
    EMBEDDING = "embedding"
    """The vocabulary-split token embedding."""
    LM_HEAD = "lm_head"
    """The vocabulary-split output projection."""


@dataclass(frozen=True)
class RegionMatch:
    """A closed column→row region found in the graph."""

    kind: RegionKind
    columns: tuple[str, ...]
    """Column-split projection nodes."""
    rows: tuple[str, ...]
    """Row-split projection nodes."""
    segments: tuple[tuple[int, ...], ...]
    """Fused segments of each column projection (empty tuple: plain)."""
    replicated: tuple[str, ...] = ()
    """Projections of the region kept whole (K/V when tp does not divide the KV heads)."""
    params: tuple[tuple[str, Shard], ...] = ()
    """Other parameters split with the region (a bias added by hand after ``x @ W``): target, layout."""
    violations: tuple[Violation, ...] = ()
    """Sizes that do not divide by tp (the region cannot be split at this tp)."""
    sizes: tuple[int, ...] = ()
    """Every size the split must divide; their common divisors are the valid tp values."""
    why: str = ""
    """For a lone row: why its projection closes no column→row region."""
    shared: tuple[tuple[str, int], ...] = ()
    """Column projections whose chunks several ranks hold, with how many (K/V when tp exceeds the KV heads)."""
    convolutions: tuple[str, ...] = ()
    """Grouped convolutions split alone by whole groups (``group_splits``), their weights' parameters in ``params``."""
    row_segments: tuple[tuple[int, ...], ...] = ()
    """Fused segments of each row projection's input features (empty tuple: plain): parts concatenated before
    it, each split on its own (a single-stream block's attention heads beside its MLP channels)."""
