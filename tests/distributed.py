"""Run a function on N real gloo ranks (spawned processes) and collect each rank's JSON result.

The spawn harness itself is ``bench/ranks.py`` (one harness for tests and benchmarks); tests run every
rank on the CPU with one thread. One spawn pays the process start-up once, so a worker should check
several models per call. ``on_threads`` runs a body on simulated ranks (``ThreadComm``) in this process.
"""

from __future__ import annotations

import threading

from autotp.rewrite.comm import ThreadComm
from bench import ranks


def run_on_ranks(fn, world: int, *args) -> list:
    """``fn(rank, world, *args)`` on ``world`` gloo ranks; returns the per-rank results.

    An exception in any rank (a failed assertion included) fails the caller with that rank's traceback.
    """
    return ranks.run_on_ranks(fn, "cpu", [1] * world, *args)


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
    [t.join() for t in threads]
    if errors:
        raise errors[0]
    return results
