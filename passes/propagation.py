"""What a sharding propagation found (``propagate.py`` walks the graph; this is its result, read by the
planner, the region search, the partial-sum pass and the rewrite)."""

from __future__ import annotations

from dataclasses import dataclass, field

from autotp.passes.graph import ArgPath
from autotp.passes.placement import Layout
from autotp.passes.steps import Operator, Step


@dataclass
class Conversion:
    """Steps applied to ``source`` before ``consumers`` read it; shared by all its consumers."""

    source: str
    steps: tuple[Step, ...]
    consumers: list[tuple[str, ArgPath]] = field(default_factory=list)

    def by_reader(self, output: str) -> tuple[list[tuple[str, ArgPath]], list[tuple[str, ArgPath]]]:
        """The consumers inside the graph, and those at the model's output (node ``output``): the rewrite gives
        the latter their own copy of the steps, which a training step defers."""
        return ([c for c in self.consumers if c[0] != output], [c for c in self.consumers if c[0] == output])


@dataclass(frozen=True)
class Violation:
    """A size that must divide by tp but does not."""

    node: str
    size: int
    what: str
    origins: frozenset[str]
    """The column-split projections whose split produced this shard."""


@dataclass
class Propagation:
    """The result of propagating a set of placements through a graph."""

    tp: int
    layouts: dict[str, Layout] = field(default_factory=dict)
    conversions: dict[tuple, Conversion] = field(default_factory=dict)
    reduced: dict[str, Operator] = field(default_factory=dict)
    """Nodes whose output is all-reduced: row-split projections (``G``), vocab-split embeddings
    (``VOCAB_EMBEDDING``), sums and means over a split dim (``G``, ``MEAN``)."""
    rows: list[str] = field(default_factory=list)
    """Projections found to close a region (only with ``auto_rows``)."""
    fixes: list[tuple[str, ArgPath, object]] = field(default_factory=list)
    violations: list[Violation] = field(default_factory=list)
    hints: dict[frozenset, tuple[int, ...]] = field(default_factory=dict)
    """Column projections (by origin set) that a split wants fused into these segments."""
    origins: dict[str, frozenset] = field(default_factory=dict)
    checked: list[int] = field(default_factory=list)
    """Every size the split had to divide (for telling the user which tp values work)."""
    refusals: list[tuple[str, str]] = field(default_factory=list)
    """(node, why) for what no rewrite can make exact: an op that writes in place to a split value (it
    would write to a gathered copy)."""
    deferred: dict[str, str] = field(default_factory=dict)
    """Nodes whose partial sums are reduced later (``partial.carry_partial_sums``): node -> node after which."""
    riders: dict[str, list[str]] = field(default_factory=dict)
    """Partial sums reduced in another node's reduction, side by side with it (``dora_norms``): node -> riders."""

    def steps_of(self, operator: Operator) -> list[Conversion]:
        """Conversions that include a step of ``operator``."""
        return [c for c in self.conversions.values() if any(s.operator is operator for s in c.steps)]
