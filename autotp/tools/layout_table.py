"""The ranked layouts of a plan whose layout the planner chose (``autotp plan MODEL --devices N``), as a table."""

from __future__ import annotations

from autotp.planning import Plan


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.4g}"


def _gib(nbytes: float) -> str:
    return f"{nbytes / 2**30:.4g}"


HEADER = ("#", "layout", "ep", "step ms", "compute", "tp comm", "ep comm", "bubble", "p2p", "dp comm", "cp comm",
          "GiB/device", "fits", "vocab")


def layout_rows(plan: Plan) -> list[tuple[str, ...]]:
    """One row per ranked layout, the chosen one first: its expert-parallel ranks (ep: the routed experts divided
    among them; 1: split by tp), predicted step time and its parts (ms), memory per device."""
    return [(str(i + 1), p.layout.label(), str(p.layout.ep), _ms(p.step_time), _ms(p.compute), _ms(p.tp_comm),
             _ms(p.ep_comm), _ms(p.bubble), _ms(p.p2p), _ms(p.dp_comm), _ms(p.cp_comm), _gib(p.memory),
             "yes" if p.fits else "NO",
             "-" if p.layout.tp == 1 else "split" if p.vocab_split else "whole") for i, p in enumerate(plan.layouts)]


def layout_table(plan: Plan, devices: int, machine: str) -> str:
    """The ranked layouts of ``plan`` for ``devices`` devices on ``machine``, then the reason the plan notes."""
    rows = [HEADER, *layout_rows(plan)]
    widths = [max(len(r[c]) for r in rows) for c in range(len(HEADER))]
    lines = [f"autotp layouts for {plan.model or 'model'} on {devices} devices ({machine}), batch {plan.batch}, "
             f"seq {plan.seq}: predicted per training step (times in ms)"]
    for i, row in enumerate(rows):
        lines.append("  ".join(cell.ljust(w) if c < 2 else cell.rjust(w) for c, (cell, w) in enumerate(zip(row, widths))))
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    lines += [f"note: {n}" for n in plan.notes if n.startswith("layout ")]
    return "\n".join(lines)
