"""Run a function on N real gloo ranks (spawned processes) and collect each rank's JSON result.

The spawn harness itself is ``bench/ranks.py`` (one harness for tests and benchmarks); tests run every
rank on the CPU with one thread. One spawn pays the process start-up once, so a worker should check
several models per call. ``on_threads`` runs a body on simulated ranks (``ThreadComm``) in this process.
"""

from __future__ import annotations

import threading

from autotp.rewrite.comm import ThreadComm, join_fully
from bench import ranks


RANK_LIMIT_S = 300
"""A rank running longer (the longest group takes under a minute) is hung: it dumps its threads' stacks and exits,
well inside pytest's 600 s per test, so the failure says where each rank waited."""


def run_on_ranks(fn, world: int, *args) -> list:
    """``fn(rank, world, *args)`` on ``world`` gloo ranks; returns the per-rank results.

    An exception in any rank (a failed assertion included) fails the caller with that rank's traceback. The
    ranks are forked from the test's process, so the models it (or an earlier test) captured are captured
    already in every rank (``capture_cache``), instead of once more per rank.
    """
    return ranks.run_on_ranks(fn, "cpu", [1] * world, *args, start_method="fork", limit_s=RANK_LIMIT_S)


def on_threads(tp: int, body) -> list:
    """``body(comm)`` on ``tp`` simulated ranks (threads); their results in rank order."""
    comms, results, errors = ThreadComm.group(tp), [None] * tp, []

    def run(rank):
        try:
            results[rank] = body(comms[rank])
        except Exception as e:  # re-raised below, in the test's thread
            errors.append(e)
            comms[rank].abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(tp)]
    [t.start() for t in threads]
    join_fully(threads)  # a thread half-way out, holding MKL's allocator lock, would be copied into forked ranks
    if errors:
        raise errors[0]
    return results


def largest_first(items, ranks_of):
    """The ``items`` in order of the ranks each needs (``ranks_of(item)``), largest first, the default group
    re-formed from the first ranks before each (``bench.ranks.reform_world``): one spawn runs layouts of several
    sizes, paying the start-up once; a rank left out of a smaller group stops there."""
    for item in sorted(items, key=lambda item: -ranks_of(item)):
        if not ranks.reform_world(ranks_of(item), "cpu"):
            return
        yield item


def _each(rank: int, world: int, jobs: list) -> dict:
    return {key: fn(rank, world, *args) for key, fn, *args in jobs}


def run_each_on_ranks(world: int, jobs: dict) -> list[dict]:
    """Several workers in one spawned group of ``world`` ranks (start-up paid once), one after another:
    ``jobs`` maps a name to ``(fn, *args)``; returns, per rank, each name's result."""
    return run_on_ranks(_each, world, [[key, *job] for key, job in jobs.items()])
