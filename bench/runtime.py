"""Step time (forward + backward) of every variant, alternating in one process group; collectives per step.

Runs on every rank. Each sample is one step after a barrier; a step's time is the slowest rank's. The
variants take turns, and the order rotates every round, so drift (thermal, other load) hits them alike.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist

from bench import comm
from bench.config import BenchConfig
from bench.ranks import run_on_ranks
from bench.stats import summary, timed
from bench.torch_tp import fused_colwise_error
from bench.variants import (TOLERANCE, TP_VARIANTS, Roles, TPGroup, Variant, batch, build_model, build_variant,
                            device_of, max_diff, run_step, single_variants, training_loss)


def _slowest(seconds: float, cfg: BenchConfig) -> float:
    t = torch.tensor([seconds], dtype=torch.float64, device=device_of(cfg))
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _sample(v: Variant, rank: int, x, y, cfg: BenchConfig) -> float:
    dist.barrier()
    seconds = timed(lambda: run_step(v, x, y), cfg.device) if rank in v.ranks else 0.0
    return _slowest(seconds, cfg)


def rotations(names: list[str], rounds: int) -> list[list[str]]:
    """The order of each round: ``names`` rotated by the round number."""
    return [names[r % len(names):] + names[:r % len(names)] for r in range(rounds)]


def time_alternating(variants: dict[str, Variant], rank: int, x, y, cfg: BenchConfig) -> dict[str, list[float]]:
    """``cfg.repeats`` timed steps of every variant (after ``cfg.warmup`` untimed rounds), interleaved.

    ``load`` holds the machine's 1-minute load average after each timed round: other work shows there.
    """
    samples: dict[str, list[float]] = {n: [] for n in variants} | {"load": []}
    for r, order in enumerate(rotations(list(variants), cfg.warmup + cfg.repeats)):
        for name in order:
            seconds = _sample(variants[name], rank, x, y, cfg)
            if r >= cfg.warmup:
                samples[name].append(seconds)
        if r >= cfg.warmup:
            samples["load"].append(os.getloadavg()[0])
    return samples


def alternate(steps: dict, rounds: int, warmup: int = 2) -> dict[str, list[float]]:
    """Seconds of ``rounds`` calls of every ``steps[name]()``, taking turns (order rotated each round) after
    ``warmup`` untimed rounds; each time is the slowest rank's (every rank of the default group calls this)."""
    samples: dict[str, list[float]] = {name: [] for name in steps}
    for r, order in enumerate(rotations(list(steps), warmup + rounds)):
        for name in order:
            dist.barrier()
            t = torch.tensor([timed(steps[name])], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            if r >= warmup:
                samples[name].append(float(t.item()))
    return samples


def two_rank_command(measure, doc: str, results: Path, argv=None) -> dict:
    """The command line of a benchmark that alternates variants on 2 gloo CPU ranks: parses ``--rounds``, runs
    ``measure(rank, world, rounds)`` on both, writes rank 0's result to ``results`` (JSON) and returns it."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--rounds", type=int, default=15, help="timed rounds per variant")
    args = p.parse_args(argv)
    result = run_on_ranks(measure, "cpu", [1, 1], args.rounds)[0]
    results.write_text(json.dumps(result, indent=2) + "\n")
    return result


def check_outputs(variants: dict[str, Variant], model, x, cfg: BenchConfig) -> dict[str, dict]:
    """Each tensor-parallel variant's logits against the single model's; the reference must match."""
    tol = TOLERANCE[cfg.dtype]
    checks = {}
    for name in TP_VARIANTS:
        diff = max_diff(variants[name].module, model, x)
        checks[name] = {"max_rel_diff": diff, "ok": diff <= tol}
    # In fp32 a mismatch of the reference is a bug; in bf16 it may be rounding, so it is only reported.
    if cfg.dtype == "fp32" and not checks["megatron"]["ok"]:
        raise RuntimeError(f"the hand-written Megatron reference differs from the single model by "
                           f"{checks['megatron']['max_rel_diff']:.2e} (> {tol}); its timing would not be a fair reference")
    return checks


def _tp_variants(model, x, y, tpg: TPGroup, cfg: BenchConfig) -> tuple[dict, dict]:
    """The tensor-parallel variants, checked against the single model, and their collectives per step."""
    variants = {name: build_variant(name, model, x, tpg) for name in TP_VARIANTS}
    checks = check_outputs(variants, model, x, cfg)
    counted = {name: comm.count_step(lambda v=variants[name]: training_loss(v, x, y), lambda loss: loss)
               for name in TP_VARIANTS}
    return variants, {"checks": checks, "comm": counted, "fused_colwise": fused_colwise_error(model, tpg.mesh, x)}


def runtime_section(rank: int, r: Roles, tpg: TPGroup, cfg: BenchConfig, time_steps: bool = True) -> dict:
    """Check, count collectives of, and (with ``time_steps``) time every variant on ``cfg.runtime``'s model.

    Rank 0's result holds everything; the timings are the same on every rank.
    """
    shape = cfg.runtime
    model = build_model(shape, cfg)
    x, y = batch(shape, cfg)
    if rank in tpg.ranks:
        variants, found = _tp_variants(model, x, y, tpg, cfg)
    else:
        variants, found = {n: Variant(n, None, tpg.ranks) for n in TP_VARIANTS}, {}
    variants |= single_variants(model, r)
    samples = time_alternating(variants, rank, x, y, cfg) if time_steps else {}
    return found | {
        "shape": shape.describe(),
        "comm_minimum": comm.megatron_minimum(shape, torch.finfo(cfg.torch_dtype).bits // 8),
        "threads": {name: r.threads[min(v.ranks)] for name, v in variants.items()},
        "times": {name: summary(s) for name, s in samples.items() if name != "load"},
        "load_average": summary(samples["load"]) if samples else None,
        "samples": samples,
    }
