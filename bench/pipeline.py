"""Pipeline parallelism (issue items 1's tp=2 x pp=2 part and 5), on the ranks the other sections spawned.

``tp_pp_runtime``: autotp at tp x pp=2 against the hand-written pipeline split of the Megatron reference,
same 1F1B schedule and microbatches, alternating in one run. ``schedule_times``: autotp at tp=1, pp=2
with GPipe and 1F1B at each microbatch count, against the whole batch stepped by one rank. Both run
last in the spawned ranks: autotp's pipelines take the whole default group (world == tp x pp), so
the ranks re-form it at each section's size instead of paying for another spawn (seconds per rank).
"""

from __future__ import annotations

import dataclasses

import torch

from bench.config import BenchConfig
from bench.pp_variants import (accumulated_variant, autotp_variant, check_losses, even_cuts, hand_variant,
                               pp_mesh)
from bench.ranks import reform_world
from bench.runtime import time_alternating
from bench.stats import paired_ratio, summary
from bench.variants import Variant, batch, build_model, loss_fn

PP = 2
"""Pipeline stages (ranks along the pipeline) of both timed sections."""
SCHEDULES = ("gpipe", "1f1b")


def ideal_bubble(stages: int, microbatches: int) -> float:
    """Fraction of a GPipe/1F1B step a stage idles with equal stages: (p - 1) / (m + p - 1)."""
    if stages < 1 or microbatches < 1:
        raise ValueError(f"stages and microbatches must be >= 1, got p={stages}, m={microbatches}")
    return (stages - 1) / (microbatches + stages - 1)


def schedule_allows(schedule: str, stages: int, microbatches: int) -> bool:
    """1F1B needs a microbatch per stage to fill the pipeline (autotp raises InputError otherwise)."""
    return schedule == "gpipe" or microbatches >= stages


def efficiency(single: list[float], pipeline: list[float], stages: int) -> dict:
    """T_single / (p * T_pipeline): the share of the p ranks' time spent on the single rank's work.

    Medians, and paired by round (median of the per-round values, with a 95% bootstrap interval).
    1 - efficiency is the measured bubble, overheads included; ideal: m / (m + p - 1).
    """
    paired = paired_ratio(single, pipeline)
    return {"of_medians": summary(single)["median"] / summary(pipeline)["median"] / stages,
            **{k: paired[k] / stages for k in ("median", "low", "high")}}


def _reference_loss(model, x, y) -> float:
    with torch.no_grad():
        return float(loss_fn(model(x), y))


def _timed(variants: dict[str, Variant], rank: int, x, y, cfg: BenchConfig) -> dict:
    samples = time_alternating(variants, rank, x, y, dataclasses.replace(cfg, repeats=cfg.pp_repeats))
    return {"times": {n: summary(s) for n, s in samples.items() if n != "load"},
            "load_average": summary(samples["load"]), "samples": samples}


def _stages(pm) -> list[dict]:
    """An autotp pipeline's stages: modules, forward FLOPs per rank, parameters."""
    return [{"modules": list(s.modules), "flops": s.flops, "params": s.param_count} for s in pm.plan.stages]


def tp_pp_runtime(rank: int, cfg: BenchConfig) -> dict:
    """Item 1 at tp x pp: autotp against the hand-written split, 1F1B, on ``cfg.pp_runtime``'s model.

    ``autotp`` is cut where the hand-written split is (``cuts``), so the two differ in runtime only;
    ``autotp_balanced`` is autotp's own split, timed when it differs. ``megatron_pp_rebuilt`` builds
    its schedule every step, as autotp's ``step`` does (the cause of autotp's overhead here).
    """
    shape, m = cfg.pp_runtime, cfg.pp_microbatches
    model = build_model(shape, cfg)
    x, y = batch(shape, cfg)
    mesh = pp_mesh(cfg, PP)
    variants = {"autotp": autotp_variant(model, x, cfg.tp, PP, m, "1f1b", cuts=even_cuts(shape.n_layer, PP)),
                "megatron_pp": hand_variant(model, cfg, mesh, m, "1f1b"),
                "megatron_pp_rebuilt": hand_variant(model, cfg, mesh, m, "1f1b", rebuild=True)}
    balanced = autotp_variant(model, x, cfg.tp, PP, m, "1f1b", name="autotp_balanced")
    if _stages(balanced.module) != _stages(variants["autotp"].module):
        variants["autotp_balanced"] = balanced
    checks = check_losses(variants, _reference_loss(model, x, y), x, y, cfg, must_match=("megatron_pp",))
    return {"shape": shape.describe(), "tp": cfg.tp, "pp": PP, "microbatches": m, "schedule": "1f1b",
            "threads": torch.get_num_threads(), "checks": checks,
            "stages": {n: _stages(v.module) for n, v in variants.items() if n.startswith("autotp")},
            **_timed(variants, rank, x, y, cfg)}


def _schedule_variants(model, x, cfg: BenchConfig) -> dict[str, Variant]:
    variants = {}
    for schedule in SCHEDULES:
        for m in cfg.schedule_microbatches:
            if schedule_allows(schedule, PP, m):
                name = f"{schedule}_m{m}"
                variants[name] = autotp_variant(model, x, 1, PP, m, schedule, name=name, balance="compute")
    return variants


def schedule_times(rank: int, cfg: BenchConfig) -> dict:
    """Item 5: GPipe and 1F1B at every microbatch count (tp=1, pp=2), against one rank stepping the
    whole batch (``single``) and the same microbatches accumulated (``single_mb<m>``)."""
    shape = cfg.schedule_shape
    model = build_model(shape, cfg)
    x, y = batch(shape, cfg)
    pipelines = _schedule_variants(model, x, cfg)
    checks = check_losses(pipelines, _reference_loss(model, x, y), x, y, cfg)
    singles = {"single": Variant("single", model, frozenset({0}))}
    singles |= {f"single_mb{m}": accumulated_variant(model, m) for m in cfg.schedule_microbatches if m > 1}
    timed = _timed(singles | pipelines, rank, x, y, cfg)
    return {"shape": shape.describe(), "pp": PP, "threads": torch.get_num_threads(), "checks": checks,
            "stages": _stages(next(iter(pipelines.values())).module), **timed,
            "efficiency": _efficiencies(timed["samples"], cfg)}


def _efficiencies(samples: dict[str, list[float]], cfg: BenchConfig) -> dict[str, dict]:
    """Per timed schedule and m: efficiency against the whole batch and against the same microbatches."""
    out = {}
    for schedule in SCHEDULES:
        for m in cfg.schedule_microbatches:
            name = f"{schedule}_m{m}"
            if name not in samples:
                continue
            same_mb = samples["single" if m == 1 else f"single_mb{m}"]
            out[name] = {"schedule": schedule, "microbatches": m, "ideal": 1 - ideal_bubble(PP, m),
                         "vs_single": efficiency(samples["single"], samples[name], PP),
                         "vs_microbatched": efficiency(same_mb, samples[name], PP)}
    return out


def _skipped(size: int, world: int) -> dict:
    return {"skipped": f"needs {size} ranks, this run spawned {world} (on GPU: one per GPU)"}


def pipeline_ranks(rank: int, world: int, cfg: BenchConfig) -> dict:
    """Both timed pipeline sections, on the first tp x pp and then the first pp ranks (collective).

    Call last: it re-forms the default process group, destroying every other group.
    """
    if cfg.device == "cpu":
        # Every pipeline rank gets one core's worth; the 2-thread baseline rank drops to 1. Lowering it
        # was measured not to stall (a 1-thread process runs no OpenMP region), unlike raising it.
        torch.set_num_threads(1)
    out = {}
    if world < cfg.tp * PP:
        out["tp_pp_runtime"] = _skipped(cfg.tp * PP, world)
    elif reform_world(cfg.tp * PP, cfg.device):
        out["tp_pp_runtime"] = tp_pp_runtime(rank, cfg)
    else:
        return out
    if reform_world(PP, cfg.device):
        out["schedules"] = schedule_times(rank, cfg)
    return out
