"""What DTensor parameters cost a training step: the same tp=2 step with and without them, in one run.

    python -m bench.dtensor_cost [--rounds 30]

A 4-layer GPT (hidden 256, 8 heads, vocabulary 8192, batch 4 x 128: bench.megatron_core's shape) is parallelized
three times on 2 gloo ranks: ``dtensor`` (parameters are DTensors read through ``to_local``, replicated parameters
fingerprinted in the batch check: what ``parallelize`` builds), ``dtensor_nofp`` (the same without fingerprints)
and ``plain`` (parameters left plain and no fingerprints: what autotp ran before). One step (forward, loss,
backward, gradients dropped) of each takes turns, order rotated; ratios are medians of per-round ratios with 95%
intervals.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import torch

import autotp
import autotp.api
from autotp.runtime.drift import Fingerprints
from bench.runtime import alternate, two_rank_command
from bench.stats import paired_ratio, summary, with_interval

RESULTS = Path(__file__).parent / "results" / "dtensor_cost.json"


def _plain(model, x):
    """``model`` parallelized with plain parameters (as autotp did before DTensor parameters) and no fingerprints."""
    keep = autotp.api.expressible, autotp.api.warn_plain
    autotp.api.expressible, autotp.api.warn_plain = (lambda plan: False), (lambda plan: None)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            pm = autotp.parallelize(model, tp=2, example_inputs=(x,), quiet=True)
    finally:
        autotp.api.expressible, autotp.api.warn_plain = keep
    pm._replicated = Fingerprints({})
    return pm


def _measure(rank: int, world: int, rounds: int) -> dict:
    from examples.gpt import build_gpt

    torch.manual_seed(0)
    model = build_gpt(n_layer=4, n_embd=256, n_head=8, vocab_size=8192, block_size=128)
    x, y = (torch.randint(0, 8192, (4, 128), generator=torch.Generator().manual_seed(s)) for s in (1, 2))
    built = {"dtensor": autotp.parallelize(model, tp=2, example_inputs=(x,), quiet=True),
             "dtensor_nofp": autotp.parallelize(model, tp=2, example_inputs=(x,), quiet=True), "plain": _plain(model, x)}
    built["dtensor_nofp"]._replicated = Fingerprints({})

    def stepper(pm):
        def run():
            pm.step(x, target=y)
            for p in pm.parameters():
                p.grad = None
        return run

    samples = alternate({name: stepper(pm) for name, pm in built.items()}, rounds)
    return {"times": {k: summary(v) for k, v in samples.items()},
            "dtensor / plain": paired_ratio(samples["dtensor"], samples["plain"]),
            "dtensor_nofp / plain": paired_ratio(samples["dtensor_nofp"], samples["plain"])}


def main(argv=None) -> int:
    """Measure, print, write ``bench/results/dtensor_cost.json``."""
    r = two_rank_command(_measure, __doc__, RESULTS, argv)
    times = {k: f"{v['median'] * 1e3:.1f} ms" for k, v in r["times"].items()}
    print(f"tp=2 step: {times}; dtensor / plain {with_interval(r['dtensor / plain'])}; without fingerprints "
          f"{with_interval(r['dtensor_nofp / plain'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
