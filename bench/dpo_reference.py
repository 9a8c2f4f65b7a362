"""The reference model of a LoRA DPO fine-tune at tp=2: ``pm.reference_model()`` (frozen copies of the adapters,
the base's shards shared) against a second parallel module of the model (a second base shard), in bytes per rank,
and the time of one no-grad forward of each (and of the trained module itself).

    python -m bench.dpo_reference

The model of ``bench.lora`` (a Llama of hidden 512, 4 layers, vocabulary 4096, peft's LoRA r=16 on every
projection); batch 4 x 128 tokens; ranks are CPU processes over gloo (one thread each).
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch

from bench.lora import BATCH, SEQ, VOCAB, _adapted
from bench.memory import tensor_bytes
from bench.ranks import run_on_ranks

RESULTS = Path(__file__).parent / "results" / "dpo_reference.json"
REPEATS = 5


def _forward_s(module, x) -> float:
    """Median time of a no-grad forward over REPEATS (after one warm-up)."""
    times = []
    with torch.no_grad():
        for i in range(REPEATS + 1):
            start = time.perf_counter()
            module(x)
            if i:
                times.append(time.perf_counter() - start)
    return statistics.median(times)


def on_ranks(rank: int, world: int) -> dict:
    """This rank's bytes: the trained module, its ``reference_model()`` copies, a second parallel module."""
    import autotp

    x = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    pm = autotp.parallelize(_adapted(), tp=world, example_inputs=(x,), quiet=True)
    ref = pm.reference_model()
    second = autotp.parallelize(_adapted().requires_grad_(False), tp=world, example_inputs=(x,), quiet=True)
    times = {}
    for name, module in (("second_module", second), ("module", pm), ("reference_model", ref)):
        times[f"{name}_forward_s"] = _forward_s(module, x)
    return {"module_mb": tensor_bytes(pm.parameters()) / 1e6,
            "reference_model_mb": tensor_bytes(ref._copies.values()) / 1e6,
            "second_module_mb": tensor_bytes(second.parameters()) / 1e6, **times}


def main() -> None:
    """Measure on 2 ranks, print, and write ``bench/results/dpo_reference.json``."""
    result = run_on_ranks(on_ranks, "cpu", [1, 1])[0]
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
