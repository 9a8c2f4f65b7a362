"""autotp's benchmarks: step time against hand-written Megatron and torch's parallelize_module, collectives
against Megatron's minimum, memory per rank, preparation time, and pipelines (tp x pp against a hand-written
split, GPipe/1F1B against the ideal bubble, stage imbalance). ``python -m bench [--quick]``.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time

import torch

from bench.config import SECTIONS, BenchConfig, make_config


def parse_args(argv=None) -> argparse.Namespace:
    """The command line."""
    p = argparse.ArgumentParser(prog="python -m bench", description="autotp's benchmarks; writes <out>/<label>.md "
                                "and .json (label: [quick-]<device>-<dtype>). See docs/BENCHMARKS.md.")
    p.add_argument("--quick", action="store_true", help="tiny shapes, few repeats (for CI: under a minute)")
    p.add_argument("--out", default=os.path.join("bench", "results"), help="folder for <label>.md and .json")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cpu: gloo processes; cuda: NCCL, a GPU each")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {','.join(SECTIONS)}")
    p.add_argument("--repeats", type=int, default=None, help="timed steps per variant (default: preset)")
    p.add_argument("--prep-layers", default=None, help="comma-separated depths preparation is timed at (default: "
                   "preset; the CI smoke test takes shallow ones)")
    return p.parse_args(argv)


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def machine(cfg: BenchConfig) -> dict:
    """What the numbers were measured on."""
    pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 0
    device = "CPU only (gloo)"
    if cfg.device == "cuda":
        device = f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)} (NCCL)"
    return {"cpu": _cpu_name(), "cores": os.cpu_count(), "memory_gib": pages / 2**30, "device": device,
            "torch": torch.__version__, "python": platform.python_version(), "platform": platform.platform(),
            # Other work on the machine skews timings; the 1-minute load average says whether there was any.
            "load_average_start": os.getloadavg()[0]}


def _ranked(cfg: BenchConfig) -> dict:
    from bench.ranks import run_on_ranks
    from bench.variants import roles
    from bench.workers import rank_main

    per_rank = run_on_ranks(rank_main, cfg.device, list(roles(cfg).threads), cfg)
    out = {}
    for section in ("runtime", "pipeline"):
        if section in per_rank[0]:
            out[section] = per_rank[0][section]
    memory = [r["memory"] for r in per_rank if "memory" in r]
    if memory:
        out["memory"] = memory
    return out


def run(cfg: BenchConfig) -> dict:
    """Every section ``cfg`` asks for; the results as one JSON-ready dict."""
    from bench.imbalance import imbalance_section
    from bench.prep import prep_section
    from bench.workers import needs_ranks

    results: dict = {}
    if needs_ranks(cfg):
        results |= _ranked(cfg)
    if "prep" in cfg.sections:
        results["prep"] = prep_section(cfg)
    if "pipeline" in cfg.sections:
        results["pipeline"] = results.get("pipeline", {}) | {"imbalance": imbalance_section(cfg)}
    return results


def _depths(text: str | None) -> tuple[int, ...] | None:
    """``--prep-layers 2,4`` as (2, 4); None when not given. Raises ValueError on anything but positive integers."""
    if text is None:
        return None
    depths = tuple(int(part) for part in text.split(",") if part.strip())
    if not depths or min(depths) < 1:
        raise ValueError(f"--prep-layers takes positive depths, got {text!r}")
    return depths


def main(argv=None) -> int:
    """Run the benchmark and write its markdown table and JSON; prints where they went."""
    from bench.report import write

    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("--device cuda: no GPU visible to torch (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    try:
        cfg = make_config(args.quick, args.device, args.dtype, tuple(filter(None, args.sections.split(","))),
                          args.repeats, _depths(args.prep_layers))
    except ValueError as e:
        print(f"bad arguments: {e}", file=sys.stderr)
        return 2
    start, host = time.perf_counter(), machine(cfg)
    results = run(cfg)
    host["load_average_end"] = os.getloadavg()[0]
    command = "python -m bench " + " ".join(sys.argv[1:] if argv is None else argv)
    results = {"label": cfg.label, "command": command.strip(), "config": cfg.to_dict(), "machine": host,
               "seconds": time.perf_counter() - start} | results
    md, js = write(results, args.out)
    print(f"wrote {md} and {js} in {results['seconds']:.0f} s")
    return 0
