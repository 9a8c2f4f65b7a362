"""Pictures of a plan: the model's graph coloured by decision (SVG, PNG, HTML, DOT) and pipeline timelines.

    vg = viz_graph(captured, plan, param_infos(model), batch=8, seq=64)
    fig, tooltips = draw_graph(vg); save(fig, "plan.svg", PictureFormat.SVG, vg.title, tooltips)
    open("plan.dot", "w").write(to_dot(vg))
"""

from autotp.tools.viz.dot import to_dot
from autotp.tools.viz.draw import draw_graph
from autotp.tools.viz.model import Box, Decision, VizGraph, VizNode, viz_graph
from autotp.tools.viz.output import PictureFormat, format_for, save
from autotp.tools.viz.timeline import Schedule, Timeline, draw_timeline, simulate, stage_costs

__all__ = [
    "Box", "Decision", "PictureFormat", "Schedule", "Timeline", "VizGraph", "VizNode", "draw_graph", "draw_timeline",
    "format_for", "save", "simulate", "stage_costs", "to_dot", "viz_graph",
]
