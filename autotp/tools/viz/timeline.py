"""The pipeline timeline: when each stage runs each microbatch's forward and backward, and the bubble.

Box lengths come from the cost model: a stage's forward on one microbatch takes its FLOPs per rank
divided by the microbatch count, and the backward twice that. Communication is not drawn.
"""

from __future__ import annotations

from dataclasses import dataclass

from autotp.errors import InputError
from autotp.options import Schedule


BACKWARD_FACTOR = 2.0
"""Backward cost relative to forward (gradients of inputs and of weights: two matmuls per forward one)."""


@dataclass(frozen=True)
class Box:
    """One forward (``F``) or backward (``B``) of one microbatch on one stage."""

    stage: int
    micro: int
    phase: str
    start: float
    end: float


@dataclass(frozen=True)
class Timeline:
    """A simulated schedule: its boxes, total time and idle fraction."""

    schedule: Schedule
    boxes: tuple[Box, ...]
    makespan: float
    bubble: float
    """Fraction of stage-time spent idle: 1 - busy / (stages x makespan)."""


def stage_order(schedule: Schedule, stage: int, stages: int, micro: int) -> list[tuple[str, int]]:
    """The order in which ``stage`` runs its forwards and backwards."""
    if schedule is Schedule.GPIPE:
        return [("F", m) for m in range(micro)] + [("B", m) for m in range(micro)]
    warmup = min(stages - stage - 1, micro)
    order = [("F", m) for m in range(warmup)]
    for m in range(micro - warmup):
        order += [("F", warmup + m), ("B", m)]
    return order + [("B", m) for m in range(micro - warmup, micro)]


def _dependencies(phase: str, stage: int, micro: int, stages: int) -> list[tuple[str, int, int]]:
    if phase == "F":
        return [("F", stage - 1, micro)] if stage > 0 else []
    return [("F", stage, micro)] + ([("B", stage + 1, micro)] if stage + 1 < stages else [])


def simulate(forward: list[float], microbatches: int, schedule: Schedule) -> Timeline:
    """Run ``schedule`` with per-stage forward times ``forward`` (one microbatch each); backward is 2x.

    A forward waits for the previous stage's forward of the same microbatch, a backward for the next
    stage's backward and its own forward; each stage runs one thing at a time, in its order.
    """
    if microbatches < 1 or not forward:
        raise InputError(f"a timeline needs at least one stage and one microbatch, got {len(forward)} stages "
                         f"and {microbatches} microbatches")
    n = len(forward)
    orders = [stage_order(schedule, s, n, microbatches) for s in range(n)]
    done: dict[tuple[str, int, int], float] = {}
    free, nxt, boxes = [0.0] * n, [0] * n, []
    while len(boxes) < 2 * n * microbatches:
        progressed = False
        for s in range(n):
            if nxt[s] == len(orders[s]):
                continue
            phase, m = orders[s][nxt[s]]
            deps = _dependencies(phase, s, m, n)
            if any(d not in done for d in deps):
                continue
            start = max([free[s]] + [done[d] for d in deps])
            end = start + forward[s] * (1.0 if phase == "F" else BACKWARD_FACTOR)
            boxes.append(Box(s, m, phase, start, end))
            done[(phase, s, m)], free[s], nxt[s], progressed = end, end, nxt[s] + 1, True
        if not progressed:  # cannot happen for the schedules above; guards against an endless loop
            raise InputError(f"the {schedule.value} schedule deadlocked at {n} stages, {microbatches} microbatches")
    makespan = max(b.end for b in boxes)
    busy = sum(b.end - b.start for b in boxes)
    return Timeline(schedule, tuple(boxes), makespan, 1.0 - busy / (n * makespan) if makespan else 0.0)


def draw_timeline(timeline: Timeline, labels: list[str], title: str):
    """A matplotlib Figure: one row per stage, forward and backward boxes, the bubble fraction in the title."""
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch, Rectangle

    rows = len(labels)
    top, bottom, body = 0.8, 0.6, 0.55 * rows  # inches: title, axis label, one row per stage
    height = top + body + bottom
    fig = Figure(figsize=(11, height))
    ax = fig.add_axes((0.2, bottom / height, 0.77, body / height))
    colours = {"F": "#9ecae9", "B": "#4c78a8"}
    for b in timeline.boxes:
        ax.add_patch(Rectangle((b.start, b.stage - 0.38), b.end - b.start, 0.76, facecolor=colours[b.phase],
                               edgecolor="white", lw=0.8))
        if (b.end - b.start) / timeline.makespan > 0.018:
            ax.text((b.start + b.end) / 2, b.stage, str(b.micro), ha="center", va="center", fontsize=7,
                    color="black" if b.phase == "F" else "white")
    ax.set_xlim(0, timeline.makespan)
    ax.set_ylim(rows - 0.5, -0.5)
    ax.set_yticks(range(rows), labels, fontsize=8)
    ax.set_xlabel("time, as GFLOP per rank (backward = 2 × forward; communication not drawn)", fontsize=8)
    ax.tick_params(axis="x", labelsize=7)
    ax.set_title(f"{title}\n{timeline.schedule.value}, {rows} stage{'s' * (rows > 1)}, "
                 f"{len({b.micro for b in timeline.boxes})} microbatches: bubble {timeline.bubble:.1%}",
                 fontsize=10, loc="left")
    ax.legend(handles=[Patch(facecolor=colours["F"], label="forward"), Patch(facecolor=colours["B"], label="backward")],
              loc="lower right", bbox_to_anchor=(1.0, 1.0), ncol=2, fontsize=8, frameon=False)
    return fig


def stage_costs(stages, per_rank_params: float, batch: int, seq: int, scale: float = 1.0) -> list[tuple[str, float]]:
    """(label, forward GFLOP per rank for the whole batch) of each pipeline stage.

    ``stages`` are the plan's (their FLOPs times ``scale``, to move them to another batch and sequence);
    without any, one stage costed as 2 x parameters x tokens, the usual estimate of a forward pass.
    """
    if stages:
        return [(f"stage {s.index} · {s.flops * scale / 1e9:.3g} GFLOP", s.flops * scale / 1e9) for s in stages]
    gflop = 2 * per_rank_params * batch * seq / 1e9
    return [(f"whole model · {gflop:.3g} GFLOP (2 × params × tokens)", gflop)]
