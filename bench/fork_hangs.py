"""How often a rank forked right after threads of matrix products hangs: threads joined with ``Thread.join`` against
``autotp.rewrite.comm.join_fully`` (the test harness forks its ranks after the one-process checker's threads).

    python -m bench.fork_hangs                # 300 rounds per way of joining, alternating
    python -m bench.fork_hangs --rounds 900

A round runs ``THREADS`` threads of small matrix products (as the checker's simulated ranks do) and joins them,
runs one product on the main thread (as a test does before forking), then forks 2 ranks that each run 200
products on one thread. A rank not done after ``LIMIT_S`` seconds (a healthy one takes well under one) is hung:
counted, killed, and the next round begins. The two ways alternate round by round, in one process.
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time

import torch
import torch.multiprocessing as mp

from autotp.rewrite.comm import join_fully
from bench.ranks import stop_ranks

LIMIT_S = 10.0
THREADS = 6


def _plain_join(threads: list[threading.Thread]) -> None:
    for thread in threads:
        thread.join()


WAYS = {"Thread.join": _plain_join, "join_fully": join_fully}


def _rank(rank: int) -> None:
    torch.set_num_threads(1)
    layer, x = torch.nn.Linear(64, 64), torch.randn(8, 16, 64)
    for _ in range(200):
        x = torch.tanh(layer(x))


def _products() -> None:
    layer, x = torch.nn.Linear(256, 256), torch.randn(64, 256)
    for _ in range(20):
        layer(x).sum().backward()


def hangs_after(join, rounds: int) -> dict:
    """``rounds`` rounds whose threads are joined by ``join``: how many left a forked rank hung."""
    hung, seconds = 0, 0.0
    for _ in range(rounds):
        started = time.perf_counter()
        threads = [threading.Thread(target=_products) for _ in range(THREADS)]
        [t.start() for t in threads]
        join(threads)
        torch.randn(512, 512) @ torch.randn(512, 512)
        context = mp.start_processes(_rank, nprocs=2, join=False, start_method="fork")
        deadline = time.monotonic() + LIMIT_S
        while not context.join(timeout=1) and time.monotonic() < deadline:
            pass
        hung += any(p.is_alive() for p in context.processes)
        stop_ranks(context.processes)
        seconds += time.perf_counter() - started
    return {"rounds": rounds, "hung": hung, "seconds": round(seconds, 1)}


def main() -> None:
    """Alternate the ways of joining in batches of 10 rounds; print the table, write bench/results/fork_hangs.json."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=300)
    args = parser.parse_args()
    totals = {name: {"rounds": 0, "hung": 0, "seconds": 0.0} for name in WAYS}
    for _ in range(max(1, args.rounds // 10)):
        for name, join in WAYS.items():
            for key, value in hangs_after(join, 10).items():
                totals[name][key] += value
    for name, row in totals.items():
        print(f"{name:12s} {row['hung']:4d} of {row['rounds']} forks hung ({row['seconds']:.0f} s)", flush=True)
    os.makedirs("bench/results", exist_ok=True)
    with open("bench/results/fork_hangs.json", "w") as f:
        json.dump(totals, f, indent=1)


if __name__ == "__main__":
    main()
