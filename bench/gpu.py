"""The device check: autotp's CUDA/NCCL path against the unsharded model, its figures written to the docs.

    python -m bench.gpu                                  # on a machine with a GPU: writes docs/BENCHMARKS.md
    python -m bench.gpu --device cpu --small --out x.md  # the CPU smoke test (tests/test_bench_gpu.py)

Each part (``bench.gpu_parts``) runs in a process of its own under a time limit, so one that hangs or crashes (a
CUDA error, a NCCL wait) is reported and the others still run:

- ``checker``: ``autotp.check`` at tp=2 on the device, fp32 and bf16;
- ``single``: AdamW steps at tp=1 on the device, fp32 and a bf16 policy, against the unsharded model; step times;
- ``generation``: greedy ``pm.generate`` against transformers' ``generate`` on the device (tokens, tokens/s);
- ``ranks``: tp=2 on two ranks (NCCL where two GPUs exist; gloo in CPU mode): training with torch's clipping,
  fp32 and bf16 policy, step times, and generation.

The default limits add up to 8 minutes (``--budget`` scales them). The figures go into the section of
``--out`` between this script's markers (replaced, or appended at the end), naming the device, torch and the date;
``--json`` also writes them whole.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

LIMITS_S = {"checker": 120, "single": 90, "generation": 120, "ranks": 150}
"""Each part's share of the time, in seconds (480 in all: the whole run fits in 8 minutes on an H200)."""

DOCS = Path(__file__).resolve().parent.parent / "docs" / "BENCHMARKS.md"
START, END = "<!-- bench.gpu: start -->", "<!-- bench.gpu: end -->"


def run_part(name: str, device: str, small: bool, limit_s: float) -> dict:
    """One part in a fresh process, stopped after ``limit_s``: its figures, or how it failed."""
    command = [sys.executable, "-m", "bench.gpu", "--part", name, "--device", device, "--limit", str(limit_s)]
    start = time.perf_counter()
    try:
        done = subprocess.run(command + (["--small"] if small else []), capture_output=True, text=True,
                              timeout=limit_s)
    except subprocess.TimeoutExpired:
        return {"status": f"timed out after {limit_s:.0f} s"}
    seconds = round(time.perf_counter() - start, 1)
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return {"status": f"failed (exit {done.returncode}): {last[:300]}", "seconds": seconds}
    return {"status": "ok", "seconds": seconds, **json.loads(lines[-1])}


def one_part(name: str, device: str, small: bool, limit_s: float) -> dict:
    """The figures of part ``name`` run in this process (the child ``run_part`` starts)."""
    import warnings

    from bench import gpu_parts

    warnings.simplefilter("ignore")
    if name == "ranks":
        return gpu_parts.ranks(device, small, limit_s=max(limit_s - 15, 10))
    return getattr(gpu_parts, name)(device, small)


def device_name(device: str) -> str:
    """The device in words: the GPU's name and count, or the CPU's."""
    import torch

    if device == "cuda":
        count = torch.cuda.device_count()
        return f"{count} x {torch.cuda.get_device_name(0)}"
    return f"CPU ({platform.processor() or platform.machine()})"


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.3g}"
    return str(value)


def _flat(prefix: str, value, out: list) -> None:
    """``value``'s leaves as (dotted name, value) rows; a list of rows stays one row each."""
    if isinstance(value, dict):
        for key, inner in value.items():
            _flat(f"{prefix}.{key}" if prefix else key, inner, out)
    elif isinstance(value, list) and value and isinstance(value[0], dict):
        for row in value:
            label = " ".join(str(row[k]) for k in ("model", "dtype") if k in row)
            _flat(f"{prefix}[{label}]", {k: v for k, v in row.items() if k not in ("model", "dtype")}, out)
    else:
        out.append((prefix, value))


def section(results: dict, device: str, command: str) -> str:
    """The markdown section of ``results``: the device, torch, the date, the command, then every figure."""
    import torch

    lines = [START, "## Device check (`python -m bench.gpu`)", "",
             f"{device_name(device)}, torch {torch.__version__}, {datetime.date.today().isoformat()}. "
             f"Reproduce: `{command}`. Each part against the unsharded model on the same device (differences are "
             "absolute; a bf16 run is judged against the unsharded model's own bf16-vs-fp32 gap).", "",
             "| part | figure | value |", "|---|---|---|"]
    for part, found in results.items():
        rows: list = []
        _flat("", found, rows)
        for name, value in rows:
            lines.append(f"| {part} | {name} | {_fmt(value)} |")
    return "\n".join(lines + ["", END]) + "\n"


def write_section(path: Path, text: str) -> None:
    """Put ``text`` in ``path`` between the markers (replacing what was there), else at its end."""
    old = path.read_text() if path.exists() else ""
    if START in old and END in old:
        head, rest = old.split(START, 1)
        tail = rest.split(END, 1)[1].lstrip("\n")
        new = head + text + tail
    else:
        new = old + ("\n" if old and not old.endswith("\n\n") else "") + text
    path.write_text(new)


def main(argv=None) -> int:
    """Run every part (or ``--part`` alone, printing its JSON) and write the section."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default=None,
                        help="default: cuda where a GPU is, else cpu")
    parser.add_argument("--small", action="store_true", help="smoke-test sizes (the CPU test)")
    parser.add_argument("--parts", default=",".join(LIMITS_S), help="comma-separated, of " + ",".join(LIMITS_S))
    parser.add_argument("--budget", type=float, default=1.0, help="scale every part's time limit")
    parser.add_argument("--out", type=Path, default=DOCS, help="the markdown file the section goes into")
    parser.add_argument("--json", type=Path, default=None, help="also write every figure here")
    parser.add_argument("--part", choices=tuple(LIMITS_S), help=argparse.SUPPRESS)
    parser.add_argument("--limit", type=float, default=60.0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.part:
        print(json.dumps(one_part(args.part, args.device, args.small, args.limit)))
        return 0
    results = {}
    for name in args.parts.split(","):
        if name not in LIMITS_S:
            parser.error(f"unknown part {name!r}; the parts are {', '.join(LIMITS_S)}")
        results[name] = run_part(name, args.device, args.small, LIMITS_S[name] * args.budget)
        print(f"{name}: {results[name]['status']} ({results[name].get('seconds', '-')} s)", flush=True)
    shown = "python -m bench.gpu" + (f" --device {args.device} --small" if args.small else "")
    write_section(args.out, section(results, args.device, shown))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    print(f"wrote the section to {args.out}")
    return 0 if all(r["status"] == "ok" for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
