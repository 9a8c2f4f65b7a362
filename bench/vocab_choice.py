"""The vocabulary split or whole: step time of both fixed choices and of the planner's, alternating.

    python -m bench.vocab_choice [--rounds 15]

Two gloo ranks on the CPU (one thread each) step examples.gpt's GPT at tp=2 through ``pm.step(x, target=y)``
with ``vocab="split"`` (Megatron's choice: vocab-parallel embedding, head and loss), ``vocab="whole"`` (both
tables on every rank, no vocabulary communication) and the default ``vocab="auto"`` (the cost model's
choice). The variants take turns every round (order rotated); a step's time is the slower rank's. Ratios
are medians of per-round ratios with 95% bootstrap intervals. Also prints the calibration the cost model's
CPU machine (``autotp.planning.machines.CPU``) was set from: a matmul's rate and gloo all-reduce times.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
import torch.distributed as dist

import autotp
from bench.config import ModelShape
from bench.runtime import alternate, two_rank_command
from bench.stats import paired_ratio, summary, timed, with_interval
from examples.gpt import build_gpt

SHAPES = {
    "vocab 512 (4 x 256)": ModelShape(n_layer=4, n_head=8, n_embd=256, vocab_size=512, batch=4, seq=128),
    "vocab 8192 (4 x 256, the runtime GPT)": ModelShape(n_layer=4, n_head=8, n_embd=256, vocab_size=8192, batch=4,
                                                        seq=128),
}
CHOICES = ("split", "whole", "auto")
RESULTS = Path(__file__).parent / "results" / "vocab_choice.json"


def _step(pm, x, y) -> None:
    pm.step(x, target=y)
    for p in pm.parameters():
        p.grad = None


def _shape_times(shape: ModelShape, rounds: int) -> dict:
    torch.manual_seed(0)
    model = build_gpt(**shape.gpt_kwargs())
    gen = torch.Generator().manual_seed(1)
    x, y = (torch.randint(0, shape.vocab_size, (shape.batch, shape.seq), generator=gen) for _ in range(2))
    pms = {c: autotp.parallelize(model, tp=2, example_inputs=x, vocab=c) for c in CHOICES}
    samples = alternate({c: (lambda c=c: _step(pms[c], x, y)) for c in CHOICES}, rounds)
    auto_split = any(p.is_split and p.kind.word == "vocab" for p in pms["auto"].plan.placements.values())
    chose = "split" if auto_split else "whole"
    best = min(("split", "whole"), key=lambda c: summary(samples[c])["median"])
    return {"times": {c: summary(s) for c, s in samples.items()},
            "whole / split": paired_ratio(samples["whole"], samples["split"]),
            "auto chose": chose, "best": best,
            "same placements as its choice": pms["auto"].plan.placements == pms[chose].plan.placements,
            "auto / best": paired_ratio(samples["auto"], samples[best]),
            "note": next(n for n in pms["auto"].plan.notes if n.startswith("vocabulary of"))}


def _calibration() -> dict:
    out = {}
    for nbytes in (2**19, 2**21):
        t = torch.ones(nbytes // 4)
        for _ in range(3):
            dist.all_reduce(t)
        start = time.perf_counter()
        for _ in range(20):
            dist.all_reduce(t)
        out[f"all_reduce {nbytes // 1024} KiB ms"] = (time.perf_counter() - start) / 20 * 1e3
    a, b = torch.randn(512, 256), torch.randn(256, 8192)
    a @ b
    out["matmul GFLOP/s"] = 2 * 512 * 256 * 8192 / timed(lambda: a @ b) / 1e9
    return out


def _measure(rank: int, world: int, rounds: int) -> dict:
    return {"calibration": _calibration()} | {label: _shape_times(s, rounds) for label, s in SHAPES.items()}


def table(results: dict) -> str:
    """The results as a Markdown table."""
    lines = ["| model | split ms | whole ms | auto ms | whole / split | auto chose | auto / best fixed |",
             "|---|---|---|---|---|---|---|"]
    for label, r in results.items():
        if label == "calibration":
            continue
        ms = {c: r["times"][c]["median"] * 1e3 for c in CHOICES}
        ws, ab = r["whole / split"], r["auto / best"]
        lines.append(f"| {label} | {ms['split']:.1f} | {ms['whole']:.1f} | {ms['auto']:.1f} | "
                     f"{with_interval(ws)} | {r['auto chose']} | "
                     f"{with_interval(ab)} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    """Measure, print the table and the calibration, write ``bench/results/vocab_choice.json``."""
    results = two_rank_command(_measure, __doc__, RESULTS, argv)
    print(table(results))
    print("calibration:", {k: round(v, 2) for k, v in results["calibration"].items()})


if __name__ == "__main__":
    main()
