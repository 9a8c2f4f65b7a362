"""An MoE training step with its experts expert-split (``ep`` = tp) against tensor-split (ep=1), in one run on
CPU gloo ranks: median step time, all-reduce bytes per step (counted at run time), per-rank parameter memory.

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


def _measure(rank: int, world: int, ep: int) -> dict:
    ids = torch.randint(0, 512, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    pm = autotp.parallelize(build(), tp=world, ep=ep, vocab="whole", example_inputs=(ids,))
    loss = lambda out: out.logits.square().mean()  # noqa: E731
    counted = count_step(lambda: pm(ids), loss)
    times = []
    for _ in range(STEPS):
        start = time.perf_counter()
        loss(pm(ids)).backward()
        times.append(time.perf_counter() - start)
    local = [p.to_local() if hasattr(p, "to_local") else p for p in pm.parameters()]
    return {"step_s": statistics.median(times),
            "bytes": sum(counted[d].get("all_reduce", {"bytes": 0})["bytes"] for d in ("forward", "backward")),
            "param_bytes": sum(p.numel() * p.element_size() for p in local)}


def main(argv=None) -> int:
    """Print one JSON line per layout."""
    args = _parser().parse_args(argv)
    for ep in (1, args.world):
        ranks = run_on_ranks(_measure, "cpu", [1] * args.world, ep, start_method="spawn")
        print(json.dumps({"world": args.world, "tp": args.world, "ep": ep,
                          "step_ms": round(1000 * max(r["step_s"] for r in ranks), 1),
                          "all_reduce_MiB_per_step": round(ranks[0]["bytes"] / 2**20, 2),
                          "param_MiB_per_rank": round(ranks[0]["param_bytes"] / 2**20, 2)}), flush=True)
    return 0


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=4)
    return p


if __name__ == "__main__":
    raise SystemExit(main())
