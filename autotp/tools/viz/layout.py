"""A small layered (Sugiyama-style) layout for top-to-bottom DAGs, so pictures need no Graphviz.

Layers by longest path, a dummy point per layer crossed by a long edge (so residual connections run
beside the blocks instead of through them), barycentre ordering, then x positions that pull each
node towards its neighbours without overlaps. Sizes are in inches.
"""

from __future__ import annotations

from dataclasses import dataclass

Point = tuple[float, float]


@dataclass(frozen=True)
class Layout:
    """Node centres, the polyline of every edge (from the bottom of its source to the top of its
    target), and the drawing's extent."""

    centers: dict[str, Point]
    routes: dict[tuple[str, str], list[Point]]
    width: float
    height: float


def _layers(order: list[str], preds: dict[str, list[str]], succs: dict[str, list[str]]) -> dict[str, int]:
    layer: dict[str, int] = {}
    for n in order:
        layer[n] = max((layer[p] + 1 for p in preds[n]), default=0)
    for n in reversed(order):  # sources sit right above their first reader, not at the top
        if not preds[n] and succs[n]:
            layer[n] = min(layer[s] for s in succs[n]) - 1
    return layer


def _with_dummies(edges, layer: dict[str, int]) -> tuple[list[tuple[str, str]], dict[tuple[str, str], list[str]]]:
    """Split edges longer than one layer into unit edges through dummy nodes."""
    unit, chains = [], {}
    for u, v in edges:
        chain = [u] + [f"~{u}~{v}~{k}" for k in range(layer[u] + 1, layer[v])] + [v]
        for k, d in enumerate(chain[1:-1]):
            layer[d] = layer[u] + 1 + k
        unit.extend(zip(chain, chain[1:]))
        chains[(u, v)] = chain
    return unit, chains


def _order_layers(rows: list[list[str]], preds, succs, sweeps: int = 4) -> None:
    """Barycentre heuristic, sweeping down then up, in place."""
    def barycentre(k: int, n: str, pos: dict[str, int], neighbours) -> float:
        near = [pos[m] for m in neighbours[n] if m in pos]
        return (sum(near) / len(near)) if near else k

    def sweep(indices, neighbours):
        for i in indices:
            pos = {n: k for k, n in enumerate(rows[i - 1 if neighbours is preds else i + 1])}
            ranked = sorted(enumerate(rows[i]), key=lambda item: barycentre(*item, pos, neighbours))
            rows[i] = [n for _, n in ranked]
    for _ in range(sweeps):
        sweep(range(1, len(rows)), preds)
        sweep(range(len(rows) - 2, -1, -1), succs)


def _pack(row: list[str], desired: dict[str, float], width: dict[str, float], gap: float) -> dict[str, float]:
    """x for each node of ``row`` as near ``desired`` as the order and spacing allow."""
    xs = [desired[n] for n in row]
    for i in range(1, len(row)):
        least = xs[i - 1] + (width[row[i - 1]] + width[row[i]]) / 2 + gap
        xs[i] = max(xs[i], least)
    shift = sum(desired[n] - x for n, x in zip(row, xs)) / len(row) if row else 0.0
    for i in range(len(row) - 1, -1, -1):  # move back left as far as the next node allows
        limit = xs[i + 1] - (width[row[i + 1]] + width[row[i]]) / 2 - gap if i + 1 < len(row) else float("inf")
        xs[i] = min(xs[i] + shift, limit)
    return dict(zip(row, xs))


def _x_positions(rows, preds, succs, width, gap, passes: int = 8) -> dict[str, float]:
    x: dict[str, float] = {}
    for row in rows:
        x.update(_pack(row, {n: 0.0 for n in row}, width, gap))
    for p in range(passes):
        neighbours = preds if p % 2 == 0 else succs
        indices = range(len(rows)) if p % 2 == 0 else range(len(rows) - 1, -1, -1)
        for i in indices:
            desired = {}
            for n in rows[i]:
                near = [x[m] for m in neighbours[n]] or [x[m] for m in (preds[n] + succs[n])]
                desired[n] = sum(near) / len(near) if near else x[n]
            x.update(_pack(rows[i], desired, width, gap))
    return x


def layered_layout(order: list[str], sizes: dict[str, tuple[float, float]], edges: list[tuple[str, str]],
                   hgap: float = 0.35, vgap: float = 0.32) -> Layout:
    """Lay out the DAG ``order`` (topological) with node ``sizes`` (w, h) top to bottom."""
    base_preds = {n: [] for n in order}
    base_succs = {n: [] for n in order}
    for u, v in edges:
        base_preds[v].append(u)
        base_succs[u].append(v)
    layer = _layers(order, base_preds, base_succs)
    unit, chains = _with_dummies(edges, layer)
    size = dict(sizes) | {d: (0.02, 0.0) for chain in chains.values() for d in chain[1:-1]}
    preds = {n: [] for n in size}
    succs = {n: [] for n in size}
    for u, v in unit:
        preds[v].append(u)
        succs[u].append(v)
    rank = {n: i for i, n in enumerate(order)}
    depth = max(layer.values(), default=-1) + 1
    rows: list[list[str]] = [[] for _ in range(depth)]
    # Dummies start just after the edge's source, so the first ordering follows the graph.
    for n in sorted(size, key=lambda n: rank[n] if n in rank else rank[n.split("~")[1]] + 0.5):
        rows[layer[n]].append(n)
    _order_layers(rows, preds, succs)
    width = {n: size[n][0] for n in size}
    x = _x_positions(rows, preds, succs, width, hgap)
    left = min((x[n] - width[n] / 2 for n in x), default=0.0)
    heights = [max((size[n][1] for n in row), default=0.0) for row in rows]
    tops = [sum(heights[:i]) + vgap * i for i in range(depth)]
    centers = {n: (x[n] - left, tops[layer[n]] + heights[layer[n]] / 2) for n in size}
    right = max((centers[n][0] + width[n] / 2 for n in size), default=0.0)
    return Layout({n: centers[n] for n in order}, _routes(chains, centers, size), right,
                  tops[-1] + heights[-1] if depth else 0.0)


def _routes(chains, centers, size) -> dict[tuple[str, str], list[Point]]:
    """Each edge from the bottom middle of its source, through its dummies, to the top middle of its target."""
    routes = {}
    for (u, v), chain in chains.items():
        (xu, yu), (xv, yv) = centers[u], centers[v]
        routes[(u, v)] = ([(xu, yu + size[u][1] / 2)] + [centers[d] for d in chain[1:-1]] +
                          [(xv, yv - size[v][1] / 2)])
    return routes
