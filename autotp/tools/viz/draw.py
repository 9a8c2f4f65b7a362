"""Draw a ``VizGraph`` with matplotlib: boxes coloured by decision, collectives as red hexagons,
pipeline stages as labelled clusters, a legend on top. One data unit is one inch."""

from __future__ import annotations

from autotp.tools.viz.layout import Layout, layered_layout
from autotp.planning import PlacementKind
from autotp.tools.viz.model import Box, Decision, VizGraph, VizNode
from autotp.tools.viz.output import matplotlib

COLOURS = {
    PlacementKind.COLWISE: "#9ecae9", PlacementKind.ROWWISE: "#ffbf79", PlacementKind.VOCAB: "#8cd17d",
    PlacementKind.REPLICATED: "#d7d7d7", PlacementKind.EXPERT: "#c5b0d5", Box.OPS: "#ffffff", Box.IO: "#f2f2f2",
    Box.COLLECTIVE: "#e15759", Box.COLLAPSED: "#f4f4f4",
}
"""Fill colour of each decision (pale fills keep black text readable; collectives stand out in red)."""

LEGEND = [(PlacementKind.COLWISE, "column-split"), (PlacementKind.ROWWISE, "row-split"), (PlacementKind.VOCAB, "vocab-split"),
          (PlacementKind.EXPERT, "expert-split"), (PlacementKind.REPLICATED, "replicated"), (Box.OPS, "ops (no parameters)"),
          (Box.COLLECTIVE, "collective (bytes per step)"), (Box.COLLAPSED, "repeated blocks")]

TITLE_CHAR, DETAIL_CHAR = 0.064, 0.056  # inches per character at the fonts used below
HEX_TIP = 0.1  # how far a collective's hexagon points stick out
STAGE_FILLS = ("#eef4fa", "#fbf3e8")


def node_size(node: VizNode) -> tuple[float, float]:
    """(width, height) in inches for a node's text."""
    width = max(len(node.title) * TITLE_CHAR, len(node.detail) * DETAIL_CHAR) + 0.24
    width += 2 * HEX_TIP if node.decision is Box.COLLECTIVE else 0.0
    return width, (0.38 if node.detail else 0.24)


def _box(ax, node: VizNode, x: float, y: float, w: float, h: float):
    from matplotlib.patches import FancyBboxPatch, Polygon

    fill = COLOURS[node.decision]
    if node.decision is Box.COLLECTIVE:
        t = HEX_TIP
        pts = [(x - w / 2, y), (x - w / 2 + t, y - h / 2), (x + w / 2 - t, y - h / 2),
               (x + w / 2, y), (x + w / 2 - t, y + h / 2), (x - w / 2 + t, y + h / 2)]
        patch = Polygon(pts, closed=True, facecolor=fill, edgecolor="#8c1d1f", lw=0.9, zorder=3)
    else:
        if node.decision is Box.COLLAPSED:  # a small stack of cards: more of the same behind it
            for k in (2, 1):
                ax.add_patch(FancyBboxPatch((x - w / 2 + 0.05 * k, y - h / 2 - 0.05 * k), w, h,
                                            boxstyle="round,pad=0,rounding_size=0.06", facecolor=fill,
                                            edgecolor="#888888", lw=0.6, zorder=2))
        style = "--" if node.decision is Box.OPS else "-"
        patch = FancyBboxPatch((x - w / 2, y - h / 2), w, h, boxstyle="round,pad=0,rounding_size=0.06",
                               facecolor=fill, edgecolor="#555555", lw=0.8, linestyle=style, zorder=3)
    patch.set_gid(f"node-{node.id}")
    ax.add_patch(patch)
    colour = "white" if node.decision is Box.COLLECTIVE else "black"
    if node.detail:
        ax.text(x, y - 0.065, node.title, ha="center", va="center", fontsize=7.5, color=colour, zorder=4,
                fontweight="bold" if node.decision is Box.COLLECTIVE else "normal")
        ax.text(x, y + 0.095, node.detail, ha="center", va="center", fontsize=6.5, color=colour, zorder=4)
    else:
        ax.text(x, y, node.title, ha="center", va="center", fontsize=7.5, color=colour, zorder=4)


def _edges(ax, layout: Layout) -> None:
    for points in layout.routes.values():
        xs, ys = zip(*points)
        ax.plot(xs[:-1] + (xs[-1],), ys, color="#666666", lw=0.8, zorder=1, solid_capstyle="round")
        ax.annotate("", xy=points[-1], xytext=points[-2], zorder=1,
                    arrowprops=dict(arrowstyle="-|>", color="#666666", lw=0.8, mutation_scale=8,
                                    shrinkA=0, shrinkB=0))


def _stages(ax, vg: VizGraph, layout: Layout, sizes) -> None:
    from matplotlib.patches import FancyBboxPatch

    for k, (index, label) in enumerate(vg.stages):
        members = [n for n in vg.nodes if n.stage == index]
        if not members:
            continue
        x0 = min(layout.centers[n.id][0] - sizes[n.id][0] / 2 for n in members) - 0.15
        x1 = max(layout.centers[n.id][0] + sizes[n.id][0] / 2 for n in members) + 0.15
        y0 = min(layout.centers[n.id][1] - sizes[n.id][1] / 2 for n in members) - 0.3
        y1 = max(layout.centers[n.id][1] + sizes[n.id][1] / 2 for n in members) + 0.1
        ax.add_patch(FancyBboxPatch((x0, y0), x1 - x0, y1 - y0, boxstyle="round,pad=0,rounding_size=0.1",
                                    facecolor=STAGE_FILLS[k % 2], edgecolor="#9a9a9a", lw=0.8, zorder=0))
        ax.text(x0 + 0.1, y0 + 0.14, label, ha="left", va="center", fontsize=7, style="italic",
                color="#444444", zorder=1)


def _legend_rows(width: float) -> list[list[tuple[Decision, str, float]]]:
    """The legend entries wrapped into rows that fit ``width``, each with its x offset."""
    rows: list[list[tuple[Decision, str, float]]] = [[]]
    x = 0.0
    for decision, label in LEGEND:
        span = 0.3 + len(label) * DETAIL_CHAR * 1.1
        if x + span > width and rows[-1]:
            rows.append([])
            x = 0.0
        rows[-1].append((decision, label, x))
        x += span + 0.2
    return rows


def _legend(ax, rows, top: float) -> None:
    from matplotlib.patches import Rectangle

    for r, row in enumerate(rows):
        y = top + 0.24 * r
        for decision, label, x in row:
            ax.add_patch(Rectangle((x, y - 0.07), 0.2, 0.14, facecolor=COLOURS[decision], edgecolor="#555555",
                                   lw=0.6, linestyle="--" if decision is Box.OPS else "-"))
            ax.text(x + 0.26, y, label, ha="left", va="center", fontsize=7)


def draw_graph(vg: VizGraph):
    """A matplotlib Figure of the plan's graph, and the tooltip text of each node (by SVG id)."""
    from matplotlib.figure import Figure

    matplotlib()
    sizes = {n.id: node_size(n) for n in vg.nodes}
    # Between two stages the lower cluster's label needs room above its first layer.
    layout = layered_layout([n.id for n in vg.nodes], sizes, list(vg.edges), vgap=0.45 if len(vg.stages) > 1 else 0.26)
    width = max(layout.width, 7.0)
    rows = _legend_rows(width)
    header, margin = 0.95 + 0.24 * len(rows) + (0.3 if vg.stages else 0.0), 0.3
    fig = Figure(figsize=(width + 2 * margin, layout.height + header + 2 * margin))
    ax = fig.add_axes((0, 0, 1, 1))
    ax.set_xlim(-margin, width + margin)
    ax.set_ylim(layout.height + margin, -header - margin)
    ax.axis("off")
    offset = (width - layout.width) / 2
    shifted = Layout({k: (x + offset, y) for k, (x, y) in layout.centers.items()},
                     {k: [(x + offset, y) for x, y in pts] for k, pts in layout.routes.items()},
                     layout.width, layout.height)
    ax.text(0, -header - 0.05, vg.title, fontsize=11, fontweight="bold", va="top")
    ax.text(0, -header + 0.28, vg.subtitle, fontsize=8, va="top", color="#333333")
    _legend(ax, rows, -header + 0.72)
    _stages(ax, vg, shifted, sizes)
    _edges(ax, shifted)
    for node in vg.nodes:
        _box(ax, node, *shifted.centers[node.id], *sizes[node.id])
    tooltips = {f"node-{n.id}": "\n".join(t for t in (n.title, n.detail, n.tooltip) if t) for n in vg.nodes}
    return fig, tooltips
