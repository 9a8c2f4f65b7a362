"""An MoE training step with its experts tensor-split (tp=world, ep=1) against expert-split with tokens dispatched by
all-to-all (over the tp ranks: tp=ep=world; over data-parallel ranks: tp=1, dp=ep=world), in one run on CPU gloo
ranks, one global batch: median step time, bytes per step by collective (counted at run time, mean over ranks),
per-rank parameter memory.

    python -m bench.expert_parallel --world 4
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import autotp
from bench.comm import count_step
from bench.ranks import run_on_ranks

BATCH, SEQ, STEPS = 8, 64, 5


def build():
    """A Qwen3-MoE of 2 layers, hidden 256, 16 experts of width 256, top-2."""
    import transformers

    config = transformers.Qwen3MoeConfig(vocab_size=512, hidden_size=256, intermediate_size=512,
                                         moe_intermediate_size=256, num_hidden_layers=2, num_attention_heads=8,
                                         num_key_value_heads=4, head_dim=32, num_experts=16, num_experts_per_tok=2)
    torch.manual_seed(0)
    return transformers.Qwen3MoeForCausalLM(config)


LAYOUTS = ("tp", "tp+ep", "dp+ep")
"""Experts tensor-split; expert-split over the tp ranks; expert-split over data-parallel replicas."""


def _settings(layout: str, world: int) -> dict:
    return {"tp": {"tp": world}, "tp+ep": {"tp": world, "ep": world},
            "dp+ep": {"tp": 1, "dp": world, "ep": world, "dp_mode": "replicate"}}[layout]


def _measure(rank: int, world: int, layout: str) -> dict:
    ids = torch.randint(0, 512, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    pm = autotp.parallelize(build(), vocab="whole", example_inputs=(ids,), **_settings(layout, world))
    dp = pm.dp_size
    mine = ids[pm.dp_rank * BATCH // dp:(pm.dp_rank + 1) * BATCH // dp]  # this replica's rows of the global batch
    loss = lambda out: out.logits.square().mean()  # noqa: E731
    counted = count_step(lambda: pm(mine), loss)
    times = []
    for _ in range(STEPS):
        start = time.perf_counter()
        loss(pm(mine)).backward()
        times.append(time.perf_counter() - start)
    local = [p.to_local() if hasattr(p, "to_local") else p for p in pm.parameters()]
    ops = {op for d in counted.values() for op in d}
    return {"step_s": statistics.median(times),
            "bytes": {op: sum(counted[d].get(op, {"bytes": 0})["bytes"] for d in counted) for op in ops},
            "param_bytes": sum(p.numel() * p.element_size() for p in local)}


def main(argv=None) -> int:
    """Print one JSON line per layout."""
    args = _parser().parse_args(argv)
    for layout in LAYOUTS:
        ranks = run_on_ranks(_measure, "cpu", [1] * args.world, layout, start_method="spawn")
        ops = sorted({op for r in ranks for op in r["bytes"]})
        print(json.dumps({"world": args.world, **_settings(layout, args.world),
                          "step_ms": round(1000 * max(r["step_s"] for r in ranks), 1),
                          "MiB_per_rank_per_step": {op: round(sum(r["bytes"].get(op, 0) for r in ranks)
                                                              / len(ranks) / 2**20, 2) for op in ops},
                          "param_MiB_per_rank": round(ranks[0]["param_bytes"] / 2**20, 2)}), flush=True)
    return 0


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=4)
    return p


if __name__ == "__main__":
    raise SystemExit(main())
