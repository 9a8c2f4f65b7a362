"""Low-rank adapters (LoRA) placed at their base layer's communication, never adding a collective of their own.

The region search sees an adapter's two narrow projections as a small column→row pair of its own (``A`` by its
rank, ``B`` by its rank), which all-reduces every adapter's output separately. The planner instead takes the
adapters out of the regions (``passes.adapters`` finds them) and places them by their base layer:

- base split by columns: ``A`` whole (r x in: small), ``B`` split by its outputs like the base weight, so the
  adapter's output lands on the rank that holds the base's;
- base split by rows: ``A`` split by its inputs like the base weight, ``B`` whole, applied to the partial sum
  ``A_j x_j`` before the base's single all-reduce (``passes.partial`` carries the sum through ``B``);
- base whole: the adapter whole.

An adapter on a vocabulary-split token embedding (``passes.embedding_adapters``) has ``A`` ([r, vocab]) split by
the vocabulary like the base table and ``B`` whole: its lookup's partial sum joins the base lookup's all-reduce.
"""

from __future__ import annotations

import dataclasses

from autotp.passes.adapters import Adapter
from autotp.passes.analysis import Analysis
from autotp.passes.embedding_adapters import EmbeddingAdapter
from autotp.passes.placement import REPLICATED, Placement, PlacementKind
from autotp.passes.region_match import RegionMatch


def adapter_nodes(adapters: dict[str, Adapter]) -> set[str]:
    """The projection nodes adapters are made of (their ``down`` and ``up``)."""
    return {n for a in adapters.values() for n in (a.down, a.up)}


def without_adapters(regions: list[RegionMatch], adapters: dict[str, Adapter],
                     embedding_adapters: dict[str, EmbeddingAdapter] | None = None) -> list[RegionMatch]:
    """``regions`` with the adapters' projections taken out (the up-projections of ``embedding_adapters`` too); a
    region made only of them (``B`` split alone by its input features) is dropped."""
    parts = adapter_nodes(adapters) | {a.up for a in (embedding_adapters or {}).values()}
    out = []
    for region in regions:
        keep = [i for i, c in enumerate(region.columns) if c not in parts]
        rows = [i for i, r in enumerate(region.rows) if r not in parts]
        if not keep and not rows and not region.convolutions:
            continue
        if len(keep) == len(region.columns) and len(rows) == len(region.rows):
            out.append(region)
            continue
        out.append(dataclasses.replace(
            region, columns=tuple(region.columns[i] for i in keep), segments=tuple(region.segments[i] for i in keep),
            rows=tuple(region.rows[i] for i in rows),
            row_segments=tuple(region.row_segments[i] for i in rows) if region.row_segments else (),
            shared=tuple((n, k) for n, k in region.shared if n not in parts)))
    return out


def adapter_placements(analysis: Analysis, by_target: dict[str, Placement]) -> dict[str, Placement]:
    """Each adapter's ``A`` and ``B`` weights (by ``get_attr`` target), placed by its base weight's placement in
    ``by_target`` (module docstring)."""
    out: dict[str, Placement] = {}
    for adapter in analysis.adapters.values():
        base, down, up = (analysis.projections[n] for n in (adapter.base, adapter.down, adapter.up))
        placed = by_target.get(base.weight, REPLICATED)
        out[down.weight], out[up.weight] = REPLICATED, REPLICATED
        if placed.kind is PlacementKind.COLWISE and placed.dim == base.out_dim:
            out[up.weight] = Placement(PlacementKind.COLWISE, up.out_dim, placed.segments, placed.replicas)
        elif placed.kind is PlacementKind.ROWWISE and placed.dim == base.in_dim:
            out[down.weight] = Placement(PlacementKind.ROWWISE, down.in_dim, placed.segments, placed.replicas)
    return out


def embedding_adapter_placements(analysis: Analysis, by_target: dict[str, Placement]) -> dict[str, Placement]:
    """Each embedding adapter's ``A`` split by the vocabulary (its dim 1) as its base table is in ``by_target``, and
    its ``B`` whole; both whole when the base table is (module docstring)."""
    out: dict[str, Placement] = {}
    for adapter in analysis.embedding_adapters.values():
        placed = by_target.get(analysis.embeddings[adapter.base].weight, REPLICATED)
        out[analysis.projections[adapter.up].weight] = REPLICATED
        out[adapter.table] = REPLICATED
        if placed.kind is PlacementKind.VOCAB and placed.dim == 0:
            out[adapter.table] = Placement(PlacementKind.VOCAB, 1, placed.segments, placed.replicas)
    return out
