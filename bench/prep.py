"""Preparation time: how long autotp takes to capture, analyse, plan and rewrite a model, by depth.

Each phase is timed by calling autotp's own stage functions one after another on one process (no
process group: the rewrite builds rank 0's module with its collectives unbound). ``make_plan`` runs the
passes again inside; planning proper is its time minus the passes timed on their own. The reference is a
plain ``torch.export.export(model, args, strict=False)`` of the same model, with static shapes (the
cheapest capture) and with every dimension ``Dim.AUTO`` (what autotp's capture asks for).
"""

from __future__ import annotations

import gc

import torch

from autotp.capture import capture
from autotp.options import Options
from autotp.planning import make_plan
from autotp.rewrite import rewrite
from bench.config import BenchConfig, ModelShape
from bench.stats import growth_exponent, summary, timed
from examples.gpt import build_gpt

PHASES = ("export_static", "export_dynamic", "capture", "analysis", "regions", "propagate", "make_plan", "rewrite")
"""Timed calls, in the order they run."""
PASSES = ("analysis", "regions", "propagate")
"""Read-only passes: Analysis (projections, embeddings, vocabulary), the region search, the final propagation."""


def _export(model, x, dynamic: bool):
    shapes = ({0: torch.export.Dim.AUTO, 1: torch.export.Dim.AUTO},) if dynamic else None
    return torch.export.export(model, (x,), strict=False, dynamic_shapes=shapes)


def prepare_once(model, x, tp: int) -> dict[str, float]:
    """Seconds of every phase for one preparation of ``model``; derived ``passes``, ``planning``, ``total``."""
    t: dict[str, float] = {}
    t["export_static"] = timed(lambda: _export(model, x, dynamic=False))
    t["export_dynamic"] = timed(lambda: _export(model, x, dynamic=True))
    held = {}
    t["capture"] = timed(lambda: held.update(captured=capture(model, (x,))))
    captured = held["captured"]
    t["analysis"] = timed(lambda: held.update(analysis=captured.analysis))
    t["regions"] = timed(lambda: held["analysis"].regions(tp))
    t["make_plan"] = timed(lambda: held.update(plan=make_plan(captured, Options(tp=tp))))
    plan = held["plan"]
    layouts = held["analysis"].param_layouts(plan.placements)
    t["propagate"] = timed(lambda: held["analysis"].propagate(layouts, tp))  # uncached: what one propagation costs
    t["rewrite"] = timed(lambda: rewrite(captured, plan, 0, None))
    return t | derived(t)


def derived(t: dict[str, float]) -> dict[str, float]:
    """Passes, planning (make_plan less the passes it runs) and the total of capture + plan + rewrite."""
    passes = sum(t[p] for p in PASSES)
    return {"passes": passes, "planning": max(0.0, t["make_plan"] - passes),
            "total": t["capture"] + t["make_plan"] + t["rewrite"]}


def _example(shape: ModelShape) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, shape.vocab_size, (shape.batch, shape.seq), generator=g)


def time_depth(shape: ModelShape, repeats: int, tp: int) -> dict:
    """``repeats`` preparations of a ``shape``-wide GPT: per-phase summaries and ratios to export."""
    torch.manual_seed(0)
    model = build_gpt(**shape.gpt_kwargs())
    x = _example(shape)
    runs = []
    for _ in range(repeats):
        runs.append(prepare_once(model, x, tp))
        gc.collect()
    phases = {k: summary([r[k] for r in runs]) for k in runs[0]}
    med = {k: v["median"] for k, v in phases.items()}
    return {"layers": shape.n_layer, "params": sum(p.numel() for p in model.parameters()), "phases": phases,
            "ratio_to_export_static": med["total"] / med["export_static"],
            "ratio_to_export_dynamic": med["total"] / med["export_dynamic"]}


def scaling(depths: list[dict]) -> dict[str, dict]:
    """Per phase: growth exponent in layers (1 = linear) and seconds added per layer between depths."""
    layers = [d["layers"] for d in depths]
    out = {}
    for phase in (*PHASES, "passes", "planning", "total"):
        med = [d["phases"][phase]["median"] for d in depths]
        out[phase] = {
            "exponent": growth_exponent(layers, med),
            "per_layer": [(b - a) / (lb - la) for a, b, la, lb in zip(med, med[1:], layers, layers[1:])],
        }
    return out


def prep_section(cfg: BenchConfig) -> dict:
    """Preparation time at every depth of ``cfg.prep_layers`` (width ``cfg.prep``), after a warm-up."""
    # The first export in a process pays one-off costs (imports, dispatcher caches); keep them out.
    prepare_once(build_gpt(**cfg.prep.with_(n_layer=1).gpt_kwargs()), _example(cfg.prep), cfg.tp)
    depths = []
    for n in cfg.prep_layers:
        depths.append(time_depth(cfg.prep.with_(n_layer=n), cfg.prep_repeats, cfg.tp))
        gc.collect()
    return {"shape": cfg.prep.describe(), "tp": cfg.tp, "threads": torch.get_num_threads(),
            "depths": depths, "scaling": scaling(depths)}
