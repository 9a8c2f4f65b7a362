"""``autotp viz``: the plan's graph as a picture, or with ``--schedule`` its pipeline timeline."""

from __future__ import annotations

from pathlib import Path

from autotp.errors import InputError
from autotp.planning.plan import Plan
from autotp.tools.planned import Planned, load_and_plan, plan_text


def _stage_scale(plan: Plan, batch: int, seq: int) -> float:
    """Stage FLOPs were costed at the plan's batch/seq; move them (about linearly) to the asked ones."""
    return (batch * seq) / (plan.batch * plan.seq) if plan.batch and plan.seq else 1.0


def _draw_timeline(planned: Planned, args, fmt) -> None:
    from autotp.tools.report import per_rank_param_bytes
    from autotp.tools.viz import (
        PictureFormat,
        draw_timeline,
        save,
        simulate,
        stage_costs,
    )
    from autotp.tools.viz import Schedule as TimelineSchedule

    if fmt is PictureFormat.DOT:
        raise InputError("a timeline is a chart, not a graph: write it as .svg, .png or .html")
    plan = planned.plan
    itemsize = next(iter(planned.params.values())).itemsize if planned.params else 4
    costs = stage_costs(plan.stages, per_rank_param_bytes(plan, planned.params) / itemsize, args.batch, args.seq,
                        _stage_scale(plan, args.batch, args.seq))
    micro = args.microbatches or max(4, 2 * len(costs))
    timeline = simulate([gflop / micro for _, gflop in costs], micro, TimelineSchedule(args.schedule))
    title = f"{plan.model or 'model'} · tp={plan.tp} · pp={plan.pp} · batch {args.batch}, seq {args.seq}"
    save(draw_timeline(timeline, [label for label, _ in costs], title), args.output, fmt, title,
         text=plan_text(planned, args))


def _draw_graph(planned: Planned, args, fmt) -> None:
    from autotp.capture import capture
    from autotp.tools.viz import PictureFormat, draw_graph, save, to_dot, viz_graph

    vg = viz_graph(capture(planned.model, planned.inputs), planned.plan, planned.params, args.batch, args.seq,
                   collapse=not args.expand)
    if fmt is PictureFormat.DOT:
        Path(args.output).write_text(to_dot(vg), encoding="utf-8")
        return
    fig, tooltips = draw_graph(vg)
    save(fig, args.output, fmt, vg.title, tooltips, text=plan_text(planned, args))


def run_viz(args) -> int:
    """``autotp viz``: draw the plan's graph, or with ``--schedule`` its pipeline timeline."""
    from autotp.tools.viz import format_for

    fmt = format_for(args.output, args.format)  # before any work: a bad name fails fast
    planned = load_and_plan(args)
    (_draw_timeline if args.schedule else _draw_graph)(planned, args, fmt)
    print(f"wrote {args.output}")
    return 0
