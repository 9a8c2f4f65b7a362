"""Context parallelism chosen by the layout search: Llama 3 8B/70B/405B at 131072 tokens on H100s, our ranked layouts
next to the published long-context layouts, each priced by the same cost model (no GPU needed: built on meta).

    python -m bench.context_layouts

The profiles are ``bench.layouts_at_scale``'s (3 captured layers deepened to the real depth), costed at the
sequence asked. "ours" is what ``parallelize`` runs today (cp with tp, dp, pp and recompute; not with sequence
parallelism yet); "ours, every" adds the layouts the cost model prices that autotp does not run with cp yet (cp with
sequence parallelism); "theirs" is the published layout priced by the same model, and "theirs, as autotp runs it"
the same layout among those parallelize runs (without sequence parallelism). Writes
``bench/results/context_layouts.json``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from autotp.planning.layout_search import rank_layouts
from bench.layouts_at_scale import AC, H100, profiles

LONG = 131072
RESULTS = Path(__file__).parent / "results" / "context_layouts.json"

CASES = [
    ("llama3-8b", 128, 1, LONG, None, "no published layout at this size: the search alone"),
    ("llama3-70b", 512, 1, LONG, None, "no published layout at this size: the search alone"),
    ("llama3-405b", 16384, 128, LONG, {"tp": 8, "cp": 16, "pp": 16, "dp": 8, "dp_mode": "fsdp"} | AC,
     "Llama 3 paper, Table 4, long-context stage: 16,384 H100s, TP8 CP16 PP16 DP8, 131,072 tokens, 16 sequences per "
     "DP rank, 380 TFLOPS/GPU"),
    ("llama3-405b", 1024, 512, 8192, {"tp": 8, "cp": 2, "pp": 8, "dp": 8, "dp_mode": "fsdp",
                                      "schedule": "interleaved1f1b"} | AC,
     "Megatron-Bridge LLAMA31_405B_PRETRAIN_CONFIG_H100_BF16_V1: 1024 H100s, TP8 PP8 CP2 VP8, global batch 512, "
     "8192 tokens"),
]
"""(model, devices, global batch of sequences, sequence length, published layout or None, source)."""


def _row(p) -> dict:
    return {"layout": p.layout.label(), "step s": round(p.step_time, 4), "memory GiB": round(p.memory / 2**30, 2),
            "fits": p.fits, "cp comm s": round(p.cp_comm, 4), "tp comm s": round(p.tp_comm, 4),
            "bubble s": round(p.bubble, 4)}


def compare(name: str, devices: int, batch: int, seq: int, layout: dict | None, source: str, found) -> dict:
    """Our ranked layouts (those autotp runs, then every one priced) and the published one, on H100s."""
    ours = rank_layouts(found, devices, batch, {}, H100, None)
    every = rank_layouts(found, devices, batch, {}, H100, None, every=True)
    theirs = rank_layouts(found, devices, batch, layout, H100, None, every=True) if layout else []
    runnable = rank_layouts(found, devices, batch, layout, H100, None) if layout else []
    return {"model": name, "devices": devices, "batch": batch, "seq": seq, "source": source,
            "ours": [_row(p) for p in ours[:4]], "ours, every": [_row(p) for p in every[:4]],
            "theirs": _row(theirs[0]) if theirs else None,
            "theirs, as autotp runs it": _row(runnable[0]) if runnable else None}


def _line(label: str, row: dict | None) -> str:
    if row is None:
        return f"  {label:<12} -"
    return (f"  {label:<12} {row['layout']:<40} {row['step s']:9.3f} s {row['memory GiB']:8.1f} GiB "
            f"fits={row['fits']} cp comm {row['cp comm s']:.3f} s")


def main(argv: list[str] | None = None) -> int:
    """Price every case; print and write the comparison."""
    p = argparse.ArgumentParser(prog="python -m bench.context_layouts", description=__doc__.splitlines()[0])
    p.add_argument("--models", default="llama3-8b,llama3-70b,llama3-405b")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    results, cache = [], {}
    for name, devices, batch, seq, layout, source in CASES:
        if name not in args.models.split(","):
            continue
        key = (name, batch, seq)
        if key not in cache:
            cache[key] = profiles(name, batch, seq)
        result = compare(name, devices, batch, seq, layout, source, cache[key])
        results.append(result)
        print(f"{name} on {devices} H100s, batch {batch} x {seq} tokens ({source})", flush=True)
        for i, row in enumerate(result["ours"][:3]):
            print(_line("ours" if i == 0 else "runner-up", row))
        print(_line("ours, every", result["ours, every"][0] if result["ours, every"] else None))
        print(_line("theirs", result["theirs"]))
        print(_line("theirs, runs", result["theirs, as autotp runs it"]), flush=True)
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
