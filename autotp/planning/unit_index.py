"""A profile's per-unit costs indexed by unit, computed once per profile and reused by every layout priced from it.

``layout_cost.predict`` prices a layout stage by stage; each stage's tensor-parallel collectives and
mixture-of-experts layers were found by scanning all of the profile's, so a layout of ``s`` stages cost
``s x (collectives + MoE layers)``. At DeepSeek-V3's size (125 units, about 1000 collectives, 61 MoE layers, tens
of thousands of layouts per device count, stages up to 64) that scan was most of the search. A collective's
price is its latency plus its bytes over the link's bandwidth (``machines.Link``: linear in the bytes), so a
stage's collectives are priced from their count and summed bytes, prefix sums over the units; the MoE layers are
listed per unit. The prices differ from the scan's only in the rounding of the sums (about 1e-15 relative).
"""

from __future__ import annotations

from dataclasses import dataclass

from autotp.passes.steps import CollectiveOp
from autotp.planning.expert_cost import MoeLayer


@dataclass(frozen=True)
class UnitIndex:
    """A profile's tensor-parallel collectives (as prefix sums over the units) and mixture-of-experts layers, by
    the unit holding them."""

    counts: tuple[int, ...]
    """Collectives of units ``[0, u)``, for every u (``units + 1`` entries)."""
    reduced: tuple[float, ...]
    """Bytes (global batch) of the all-reduces of units ``[0, u)``."""
    gathered: tuple[float, ...]
    """Bytes (global batch) of the other collectives (all-gathers, reduce-scatters) of units ``[0, u)``."""
    moe: tuple[tuple[MoeLayer, ...], ...]
    """Per unit, its mixture-of-experts layers, in the profile's order."""

    def collectives_in(self, units: range) -> tuple[int, float, float]:
        """(collectives, all-reduce bytes, other bytes) of ``units`` (a contiguous range)."""
        a, b = units.start, units.stop
        return (self.counts[b] - self.counts[a], self.reduced[b] - self.reduced[a],
                self.gathered[b] - self.gathered[a])

    def moe_in(self, units: range):
        """The mixture-of-experts layers of ``units``, in the profile's order."""
        return (layer for u in units for layer in self.moe[u])


_INDEXES: dict[int, tuple[object, UnitIndex]] = {}
"""id(profile) -> (the profile, kept alive so its id is not reused, and its index). Keyed by identity: hashing a
profile's tuples on every layout cost more than the scan the index saves."""

CACHED = 64
"""Profiles whose index is kept (a search prices a few per tp; the cache is emptied past this)."""


def index_of(profile) -> UnitIndex:
    """The ``UnitIndex`` of ``profile`` (a ``layout_cost.Profile``), built on its first use and kept."""
    hit = _INDEXES.get(id(profile))
    if hit is not None and hit[0] is profile:
        return hit[1]
    if len(_INDEXES) >= CACHED:
        _INDEXES.clear()
    index = index_units(len(profile.compute), profile.collectives, profile.moe)
    _INDEXES[id(profile)] = (profile, index)
    return index


def index_units(units: int, collectives, moe) -> UnitIndex:
    """The ``UnitIndex`` of a profile of ``units`` units with these ``collectives`` ((op, bytes, unit)) and ``moe``
    layers."""
    count, reduced, gathered = [0] * units, [0.0] * units, [0.0] * units
    for op, nbytes, unit in collectives:
        if 0 <= unit < units:
            count[unit] += 1
            if op is CollectiveOp.ALL_REDUCE:
                reduced[unit] += nbytes
            else:
                gathered[unit] += nbytes
    layers: list[list] = [[] for _ in range(units)]
    for layer in moe:
        if 0 <= layer.unit < units:
            layers[layer.unit].append(layer)
    return UnitIndex(_prefix(count), _prefix(reduced), _prefix(gathered), tuple(map(tuple, layers)))


def _prefix(values: list) -> tuple:
    """Running sums of ``values`` from 0 (``len(values) + 1`` entries)."""
    out = [values[0] * 0 if values else 0]
    for v in values:
        out.append(out[-1] + v)
    return tuple(out)
