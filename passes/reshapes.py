"""How reshapes move a split: where a ``Shard`` (``passes.placement``) lands when its value is viewed in
another shape, with the shape algebra (prefix products, reshape groups) that decides it."""

from __future__ import annotations

import dataclasses
import math

import sympy
from autotp.passes.placement import Shard


def static(size) -> int | None:
    """``size`` as an int when it is a constant, else None (a symbolic batch/sequence size)."""
    if isinstance(size, int):
        return size
    expr = sympy.sympify(size)
    return int(expr) if expr.is_Integer else None


def _prefixes(sizes) -> list:
    """Prefix products of ``sizes`` as sympy expressions (sizes may be symbolic)."""
    out = [sympy.Integer(1)]
    for s in sizes:
        out.append(sympy.expand(out[-1] * sympy.sympify(s)))
    return out


def _group(in_sizes, out_sizes, dim: int) -> tuple[int, int, int, int] | None:
    """The reshape group holding input ``dim``: (in_start, in_stop, out_start, out_stop).

    A reshape only regroups neighbouring dimensions; group boundaries are where the prefix products
    of both shapes agree.
    """
    pin, pout = _prefixes(in_sizes), _prefixes(out_sizes)
    starts = [(i, max(j for j, q in enumerate(pout) if q == p)) for i, p in enumerate(pin) if i <= dim and p in pout]
    stops = [(i, min(j for j, q in enumerate(pout) if q == p)) for i, p in enumerate(pin) if i > dim and p in pout]
    if not starts or not stops:
        return None
    # Innermost start and outermost stop: size-1 dims at the edges do not belong to the group.
    (i0, j0), (i1, j1) = starts[-1], stops[0]
    return i0, i1, j0, j1


def kept_dim(in_sizes, out_sizes, dim: int) -> int | None:
    """The output dim that input ``dim`` becomes when a reshape leaves it as it is (its reshape group is that one dim
    on both sides: ``[8*N, D] -> [N, 8, D]`` keeps ``D``), else None. ``map_reshape`` lands a split of such a dim
    there or nowhere, whatever its segments."""
    group = _group(in_sizes, out_sizes, dim)
    if group is None:
        return None
    i0, i1, j0, j1 = group
    return j0 if (i1 - i0, j1 - j0) == (1, 1) else None


def _rows(units: list[int], rows: int, width: int) -> tuple[int, ...] | None:
    """Split ``units`` into ``rows`` identical runs summing to ``width`` each; the run, or None."""
    runs, current, total = [], [], 0
    for u in units:
        current.append(u)
        total += u
        if total == width:
            runs.append(tuple(current))
            current, total = [], 0
        elif total > width:
            return None
    if current or len(runs) != rows or len(set(runs)) != 1:
        return None
    return runs[0]


def map_reshape(in_sizes, out_sizes, shard: Shard, tp: int) -> Shard | None:
    """Where ``shard`` lands after reshaping ``in_sizes`` to ``out_sizes``; None if it cannot be kept.

    The shard keeps its meaning (rank r holds chunk r of each segment) only if, in the output, the
    segments become whole runs along one output dim. Among the dims that allow it, the outermost
    one whose segments all divide by ``tp`` wins (``(3*H*D,) -> (3, H, D)`` shards H, not the 3).
    """
    group = _group(in_sizes, out_sizes, shard.dim)
    if group is None:
        return None
    if shard.replicas != 1:
        return _shared(in_sizes, out_sizes, shard, group, tp)
    i0, i1, j0, j1 = group
    outer_in = static(math.prod(in_sizes[i0:shard.dim])) if shard.dim > i0 else 1
    inner_in = static(math.prod(in_sizes[shard.dim + 1:i1])) if shard.dim + 1 < i1 else 1
    if inner_in is None:
        return None
    if shard.blocks != 1 or outer_in is None:
        return _blocked(in_sizes, out_sizes, shard, group, inner_in, tp)
    if outer_in > 65536:
        return None
    flat = [s * inner_in for _ in range(outer_in) for s in shard.segments]
    candidates = []
    for k in range(j0, j1):
        inner_out = static(math.prod(out_sizes[k + 1:j1])) if k + 1 < j1 else 1
        outer_out = static(math.prod(out_sizes[j0:k])) if k > j0 else 1
        width = static(out_sizes[k])
        if None in (inner_out, outer_out, width) or any(f % inner_out for f in flat):
            continue
        run = _rows([f // inner_out for f in flat], outer_out, width)
        if run is not None:
            candidates.append(Shard(k, run))
    fitting = [c for c in candidates if all(s % tp == 0 for s in c.segments)]
    return (fitting or candidates or [None])[0]


def _blocked(in_sizes, out_sizes, shard: Shard, group, inner_in: int, tp: int) -> Shard | None:
    """``map_reshape`` where the split is repeated over a symbolic number of blocks: the blocks either fold
    into one output dim with the split part (``[T, B, H*d] -> [T, B*H, d]``), or unfold out of it
    (``[B*H, T, d] -> [B, H, T, d]``), or the dim is left as it is."""
    i0, i1, j0, j1 = group
    if i1 - i0 == 1 and j1 - j0 == 1:
        return shard.moved(j0)  # the dim is kept
    outer = sympy.expand(sympy.sympify(shard.blocks) * math.prod(in_sizes[i0:shard.dim]))
    per_block = [s * inner_in for s in shard.segments]
    for k in range(j0, j1):
        inner_out = static(math.prod(out_sizes[k + 1:j1])) if k + 1 < j1 else 1
        if inner_out is None or any(f % (inner_out * tp) for f in per_block):
            continue
        run = tuple(f // inner_out for f in per_block)
        before = sympy.expand(math.prod(sympy.sympify(d) for d in out_sizes[j0:k]))
        width = sympy.expand(sympy.sympify(out_sizes[k]))
        if before == outer and width == sum(run):
            return Shard(k, run)  # the blocks unfold into the dims before
        if before == 1 and width == sympy.expand(outer * sum(run)):
            return Shard(k, run, blocks=outer)  # the blocks fold into this dim
    return None


def _shared(in_sizes, out_sizes, shard: Shard, group, tp: int) -> Shard | None:
    """``map_reshape`` of chunks several ranks hold: moved as a plain split over ``shard.chunks(tp)`` ranks would
    be, or, when the ranks sharing a chunk split the next dim (``spread``), the two dims merged into one that
    every rank holds its own chunk of (a KV head expanded over its query heads, reshaped to the query heads)."""
    i0, i1, j0, j1 = group
    if not shard.spread:
        plain = map_reshape(in_sizes, out_sizes, dataclasses.replace(shard, replicas=1), shard.chunks(tp))
        return dataclasses.replace(plain, replicas=shard.replicas) if plain is not None else None
    merged = _group(in_sizes, out_sizes, shard.dim + 1)
    if (i1 - i0, j1 - j0) == (2, 1) and merged == group and static(in_sizes[shard.dim + 1]) is not None:
        return Shard(j0, tuple(s * int(in_sizes[shard.dim + 1]) for s in shard.segments))
    return None


def broadcast_dim(out_rank: int, in_rank: int, out_dim: int) -> int:
    """The input dim aligned (from the right, as broadcasting does) with output dim ``out_dim``."""
    return out_dim - (out_rank - in_rank)
