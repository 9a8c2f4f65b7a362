"""Run a function on N real gloo ranks (spawned processes) and collect each rank's JSON result.

The spawn harness itself is ``bench/ranks.py`` (one harness for tests and benchmarks); tests run every
rank on the CPU with one thread. One spawn pays the process start-up once, so a worker should check
several models per call.
"""

from __future__ import annotations

from bench import ranks


def run_on_ranks(fn, world: int, *args) -> list:
    """``fn(rank, world, *args)`` on ``world`` gloo ranks; returns the per-rank results.

    An exception in any rank (a failed assertion included) fails the caller with that rank's traceback.
    """
    return ranks.run_on_ranks(fn, "cpu", [1] * world, *args)
