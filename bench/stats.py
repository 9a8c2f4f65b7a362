"""Timing and summary statistics: medians with their spread, ratios of medians, growth exponents."""

from __future__ import annotations

import math
import random
import statistics
import time
from collections.abc import Callable

import torch


def sync(device: str) -> None:
    """Wait for queued GPU work, so a wall-clock reading covers it (no-op on CPU)."""
    if device == "cuda":
        torch.cuda.synchronize()


def timed(fn: Callable[[], object], device: str = "cpu") -> float:
    """Seconds ``fn()`` takes, GPU work included."""
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


def summary(samples: list[float]) -> dict:
    """Median, quartiles (spread as IQR), min, max and count of ``samples``."""
    if not samples:
        raise ValueError("no samples to summarise")
    q1, _, q3 = statistics.quantiles(samples, n=4, method="inclusive") if len(samples) > 1 else samples * 3
    return {"median": statistics.median(samples), "q1": q1, "q3": q3, "iqr": q3 - q1,
            "min": min(samples), "max": max(samples), "n": len(samples)}


def ratio(a: dict, b: dict) -> float:
    """Ratio of the medians of two summaries."""
    return a["median"] / b["median"]


def paired_ratio(a: list[float], b: list[float], resamples: int = 2000, seed: int = 0) -> dict:
    """Median of the per-round ratios a[i] / b[i], with a 95% bootstrap interval over rounds.

    Pairing by round cancels drift that moves every variant of a round together (other work on the
    machine, frequency changes); the interval says how sure the median is (seeded: reproducible).
    """
    if len(a) != len(b) or not a:
        raise ValueError(f"paired samples must have the same, non-zero length, got {len(a)} and {len(b)}")
    ratios = [x / y for x, y in zip(a, b)]
    rng = random.Random(seed)
    boot = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(resamples))
    return {"median": statistics.median(ratios), "low": boot[int(0.025 * resamples)],
            "high": boot[int(0.975 * resamples) - 1]}


def with_interval(r: dict) -> str:
    """A ``paired_ratio`` as ``median [low, high]``."""
    return f"{r['median']:.3f} [{r['low']:.3f}, {r['high']:.3f}]"


def growth_exponent(sizes: list[float], times: list[float]) -> float:
    """Least-squares slope of log(time) on log(size): 1 is linear growth, 2 quadratic."""
    if len(sizes) < 2:
        return math.nan
    xs, ys = [math.log(s) for s in sizes], [math.log(max(t, 1e-9)) for t in times]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
