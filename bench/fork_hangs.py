"""How often a rank forked from a process that ran matrix products on threads hangs, with MKL's memory manager on
and off (the test harness forks its ranks, see tests/__init__.py).

    python -m bench.fork_hangs                # 300 forks of 2 ranks per setting
    python -m bench.fork_hangs --forks 900

Each setting runs in a fresh process (MKL reads ``MKL_DISABLE_FAST_MM`` when torch loads it). Per round, that
process runs a few threads of small matrix products (as the one-process checker's simulated ranks do) and joins
them, then forks 2 ranks that each run 200 products on one thread. A rank not done after ``LIMIT_S`` seconds (a
healthy one takes well under one) is hung: counted, killed, and the next round begins.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time

LIMIT_S = 10.0
THREADS = 6
"""Threads of matrix products per round, before the fork."""
SETTINGS = {"MKL memory manager on (default)": {}, "MKL_DISABLE_FAST_MM=1": {"MKL_DISABLE_FAST_MM": "1"}}


def _rank(rank: int) -> None:
    import torch

    torch.set_num_threads(1)
    layer, x = torch.nn.Linear(64, 64), torch.randn(8, 16, 64)
    for _ in range(200):
        x = torch.tanh(layer(x))


def _products_on_a_thread() -> None:
    import torch

    layer, x = torch.nn.Linear(256, 256), torch.randn(64, 256)
    for _ in range(20):
        layer(x).sum().backward()


def count_hangs(forks: int) -> dict:
    """In this process: ``forks`` rounds (threads, then 2 forked ranks); how many rounds left a rank hung."""
    import torch
    import torch.multiprocessing as mp

    hung, started = 0, time.perf_counter()
    for _ in range(forks):
        threads = [threading.Thread(target=_products_on_a_thread) for _ in range(THREADS)]
        [t.start() for t in threads]
        [t.join() for t in threads]
        torch.randn(512, 512) @ torch.randn(512, 512)  # and on the main thread, as a test does before forking
        context = mp.start_processes(_rank, nprocs=2, join=False, start_method="fork")
        deadline = time.monotonic() + LIMIT_S
        while not context.join(timeout=1) and time.monotonic() < deadline:
            pass
        alive = [p for p in context.processes if p.is_alive()]
        hung += bool(alive)
        for p in alive:
            p.kill()
            p.join()
    return {"forks": forks, "hung": hung, "seconds": round(time.perf_counter() - started, 1)}


def main() -> None:
    """Each setting in a fresh process; prints the table and writes bench/results/fork_hangs.json."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--forks", type=int, default=300)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(count_hangs(args.forks)))
        return
    rows = {}
    for name, env in SETTINGS.items():
        child_env = {k: v for k, v in os.environ.items() if k != "MKL_DISABLE_FAST_MM"} | env
        out = subprocess.run([sys.executable, "-m", "bench.fork_hangs", "--child", "--forks", str(args.forks)],
                             env=child_env, capture_output=True, text=True, check=True)
        rows[name] = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"{name:34s} {rows[name]['hung']:4d} of {rows[name]['forks']} forks hung "
              f"({rows[name]['seconds']} s)", flush=True)
    os.makedirs("bench/results", exist_ok=True)
    with open("bench/results/fork_hangs.json", "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
