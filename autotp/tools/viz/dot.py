"""A ``VizGraph`` as Graphviz DOT source: needs nothing to write, ``dot -Tsvg plan.dot`` to draw."""

from __future__ import annotations

from autotp.tools.viz.draw import COLOURS, LEGEND, STAGE_FILLS
from autotp.tools.viz.model import Box, VizGraph, VizNode


def _quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def _node(node: VizNode) -> str:
    label = node.title + (f"\n{node.detail}" if node.detail else "")
    attrs = {"label": label, "fillcolor": COLOURS[node.decision]}
    if node.decision is Box.COLLECTIVE:
        attrs |= {"shape": "hexagon", "fontcolor": "white", "color": "#8c1d1f"}
    elif node.decision is Box.OPS:
        attrs |= {"style": "rounded,filled,dashed"}
    elif node.decision is Box.COLLAPSED:
        attrs |= {"shape": "box3d", "style": "filled"}
    if node.tooltip:
        attrs["tooltip"] = node.tooltip
    body = ", ".join(f"{k}={_quote(v)}" for k, v in attrs.items())
    return f"  {_quote(node.id)} [{body}];"


def _legend() -> list[str]:
    lines = ["  subgraph cluster_legend {", '    label="legend"; fontsize=10; style=dashed;']
    for decision, label in LEGEND:
        shape = "hexagon" if decision is Box.COLLECTIVE else "box"
        lines.append(f'    "legend_{decision.value}" [label={_quote(label)}, shape={shape}, '
                     f'fillcolor="{COLOURS[decision]}"];')
    chain = " -> ".join(f'"legend_{d.value}"' for d, _ in LEGEND)
    lines += [f"    {chain} [style=invis];", "  }"]
    return lines


def to_dot(vg: VizGraph) -> str:
    """DOT source: nodes coloured by decision, collectives as hexagons, stages as clusters, a legend."""
    lines = ["digraph plan {", "  rankdir=TB; newrank=true;",
             f"  label={_quote(vg.title + chr(10) + vg.subtitle)}; labelloc=t; fontsize=14;",
             '  node [shape=box, style="rounded,filled", fontname="Helvetica", fontsize=10];',
             '  edge [color="#666666", arrowsize=0.6];']
    staged = {index: [n for n in vg.nodes if n.stage == index] for index, _ in vg.stages}
    for k, (index, label) in enumerate(vg.stages):
        lines += [f"  subgraph cluster_stage{index} {{",
                  f'    label={_quote(label)}; style="rounded,filled"; fillcolor="{STAGE_FILLS[k % 2]}";']
        lines += ["  " + _node(n) for n in staged[index]]
        lines.append("  }")
    in_stage = {n.id for nodes in staged.values() for n in nodes}
    lines += [_node(n) for n in vg.nodes if n.id not in in_stage]
    lines += [f"  {_quote(u)} -> {_quote(v)};" for u, v in vg.edges]
    lines += _legend() + ["}"]
    return "\n".join(lines) + "\n"
