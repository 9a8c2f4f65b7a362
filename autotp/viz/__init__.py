"""Pictures of a plan: the model's graph coloured by decision (SVG, PNG, HTML, DOT) and pipeline timelines.

    vg = viz_graph(captured, plan, param_infos(model), batch=8, seq=64)
    fig, tooltips = draw_graph(vg); save(fig, "plan.svg", PictureFormat.SVG, vg.title, tooltips)
    open("plan.dot", "w").write(to_dot(vg))
"""

from autotp.viz.dot import to_dot
from autotp.viz.draw import draw_graph
from autotp.viz.model import Decision, VizGraph, VizNode, viz_graph
from autotp.viz.output import PictureFormat, format_for, save
from autotp.viz.timeline import Schedule, Timeline, draw_timeline, simulate, stage_costs

__all__ = [
    "Decision", "PictureFormat", "Schedule", "Timeline", "VizGraph", "VizNode", "draw_graph", "draw_timeline",
    "format_for", "save", "simulate", "stage_costs", "to_dot", "viz_graph",
]
