"""Eager and compiled: one tensor-parallel training step with and without ``torch.compile``, alternating.

    python -m bench.compiled [--rounds 15]

Two gloo ranks on the CPU (one thread each) step the runtime benchmark's GPT (4 x 256, vocabulary 8192,
batch 4 x 128) at tp=2 through ``pm.step(x, target=y)``, from ``parallelize(..., compile=False)`` and
``compile=True`` (inductor's CPU backend); a step's time is the slower rank's; the compile itself is timed
apart (the first step of each). Ratios are medians of per-round ratios with 95% bootstrap intervals.
"""

from __future__ import annotations

from pathlib import Path

import torch

import autotp
from bench.config import ModelShape
from bench.runtime import alternate, two_rank_command
from bench.stats import paired_ratio, summary, timed, with_interval
from examples.gpt import build_gpt

SHAPE = ModelShape(n_layer=4, n_head=8, n_embd=256, vocab_size=8192, batch=4, seq=128)
RESULTS = Path(__file__).parent / "results" / "compiled.json"


def _measure(rank: int, world: int, rounds: int) -> dict:
    torch.manual_seed(0)
    model = build_gpt(**SHAPE.gpt_kwargs())
    gen = torch.Generator().manual_seed(1)
    x, y = (torch.randint(0, SHAPE.vocab_size, (SHAPE.batch, SHAPE.seq), generator=gen) for _ in range(2))
    pms = {mode: autotp.parallelize(model, tp=world, example_inputs=x, compile=mode == "compiled")
           for mode in ("eager", "compiled")}

    def step(pm):
        pm.step(x, target=y)
        for p in pm.parameters():
            p.grad = None

    first = timed(lambda: step(pms["compiled"]))
    samples = alternate({mode: (lambda pm=pm: step(pm)) for mode, pm in pms.items()}, rounds)
    return {"times": {m: summary(s) for m, s in samples.items()}, "first compiled step s": first,
            "compiled / eager": paired_ratio(samples["compiled"], samples["eager"])}


def main(argv=None) -> None:
    """Measure, print, write ``bench/results/compiled.json``."""
    r = two_rank_command(_measure, __doc__, RESULTS, argv)
    ratio = r["compiled / eager"]
    print(f"eager {r['times']['eager']['median'] * 1e3:.1f} ms, compiled {r['times']['compiled']['median'] * 1e3:.1f} "
          f"ms per step; compiled / eager {with_interval(ratio)}; "
          f"first compiled step (compiling) {r['first compiled step s']:.1f} s")


if __name__ == "__main__":
    main()
