"""Count aborted exits over consecutive torchrun runs (the gloo-at-shutdown abort of the correctness issue).

    python -m bench.exit_loop --runs 50                 # tp_demo on 2 ranks and train_gpt on 4 (tp=2 x pp=2)

A run counts as aborted when it exits non-zero or prints ``terminate called``; the command lines are
printed with the counts so the measurement can be repeated.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

COMMANDS = {
    "tp_demo (2 ranks)": ["--nproc-per-node", "2", "examples/tp_demo.py", "--steps", "1"],
    "train_gpt tp=2 x pp=2 (4 ranks)": ["--nproc-per-node", "4", "examples/train_gpt.py", "--steps", "2"],
}


def run_many(args: list[str], runs: int) -> dict:
    """Run ``torchrun ARGS`` ``runs`` times; count the aborted runs."""
    aborted, seconds = 0, []
    for _ in range(runs):
        start = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "torch.distributed.run", *args], capture_output=True, text=True)
        seconds.append(time.perf_counter() - start)
        if done.returncode != 0 or "terminate called" in done.stderr:
            aborted += 1
            print(done.stderr[-2000:], file=sys.stderr)
    return {"runs": runs, "aborted": aborted, "median_s": sorted(seconds)[len(seconds) // 2]}


def main(argv: list[str] | None = None) -> int:
    """Run each command ``--runs`` times and print the abort counts."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=50)
    args = parser.parse_args(argv)
    for name, command in COMMANDS.items():
        result = run_many(command, args.runs)
        print(f"{name}: {result['aborted']} aborted of {result['runs']} (median {result['median_s']:.1f} s); "
              f"torchrun {' '.join(command)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
