"""Context parallelism's exchange methods: bytes saved for backward and bytes moved per rank, each method at cp=2
and cp=4, next to each method's minimum (``autotp.planning.context_exchange.exchange_cost``).

    python -m bench.context_exchange [--seq 4096] [--steps 1]

A transformers Llama (4 layers, hidden 256, 8 heads over 4 KV heads so that Ulysses runs at cp=4, vocabulary
1024, batch 1) at ``--seq`` tokens on gloo ranks on the CPU (one thread each): autotp's module at cp=1 (one
process: the captured graph), then at cp=2 and cp=4 by all-gather, ring and Ulysses. Saved bytes are the storages
autograd keeps for backward in one forward (parameters excluded, ``bench.memory.SavedActivations``); bytes moved
are what each rank's exchanges received per step (forward and backward).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import autotp
from autotp.planning.context_exchange import AttentionShape, exchange_cost
from bench.context_parallel import build as build_llama
from bench.context_parallel import logits_loss
from bench.memory import SavedActivations
from bench.ranks import run_on_ranks

_EXCHANGES = ("cp_kv_", "cp_ring_", "cp_ulysses_")


def build(seed: int = 0) -> torch.nn.Module:
    """``bench.context_parallel``'s Llama with 4 KV heads, which cp=4 divides (Ulysses exchanges heads)."""
    return build_llama(seed, kv_heads=4)


def trained(pm, x, y, steps: int) -> tuple[list[float], SavedActivations, int, torch.Tensor]:
    """``steps`` timed AdamW steps of ``pm`` after one untimed: their times, the last step's bytes saved for
    backward, the K/V bytes received per step and the last loss."""
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-4)
    times = []
    for step in range(steps + 1):
        start = time.perf_counter()
        saved = SavedActivations(list(pm.parameters()))
        with saved:
            loss = pm.loss(x, target=y, loss_fn=logits_loss)
        loss.backward()
        opt.step(), opt.zero_grad()
        if step:
            times.append(time.perf_counter() - start)
    received = sum(m.received for gm in pm.rank_modules() for name, m in gm.named_modules()
                   if name.startswith(_EXCHANGES)) // (steps + 1)
    return times, saved, received, loss


def measure(rank: int, world: int, seq: int, steps: int, cp: int, exchange: str) -> dict:
    """One rank's figures at ``cp`` by ``exchange``."""
    model = build()
    x = torch.randint(0, 1024, (1, seq), generator=torch.Generator().manual_seed(1))
    y = torch.randint(0, 1024, (1, seq), generator=torch.Generator().manual_seed(2))
    pm = autotp.parallelize(model, cp=cp, tp=1, example_inputs=x, cp_exchange=exchange)
    times, saved, received, loss = trained(pm, x, y, steps)
    c = model.config
    shape = AttentionShape(1, seq, c.num_attention_heads, c.num_key_value_heads,
                           c.hidden_size // c.num_attention_heads)
    minimum = c.num_hidden_layers * exchange_cost(exchange, shape, cp).received if cp > 1 else 0
    return {"step_s": statistics.median(times), "saved": saved.bytes, "received": received, "minimum": minimum,
            "loss": float(loss.detach())}


RUNS = ((1, "all_gather"), (2, "all_gather"), (2, "ring"), (2, "ulysses"), (4, "all_gather"), (4, "ring"),
        (4, "ulysses"))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=1)
    args = parser.parse_args(argv)
    print(f"Llama 4 x 256 (8 heads, 4 KV heads), batch 1 x {args.seq}, fp32, gloo on the CPU, one thread per rank")
    print("| run | step (s, slowest rank) | saved for backward per rank | of cp=1 | received per rank per step "
          "| method's minimum | loss |")
    print("|---|---|---|---|---|---|---|")
    base = None
    for cp, exchange in RUNS:
        ranks = run_on_ranks(measure, "cpu", [1] * cp, args.seq, args.steps, cp, exchange, start_method="spawn")
        r, step = ranks[0], max(r["step_s"] for r in ranks)
        base = base or r["saved"]
        label = "cp=1" if cp == 1 else f"cp={cp} {exchange}"
        print(f"| {label} | {step:.2f} | {r['saved'] / 2**20:.1f} MiB | {r['saved'] / base:.2f} | "
              f"{r['received'] / 2**20:.2f} MiB | {r['minimum'] / 2**20:.2f} MiB | {r['loss']:.6f} |", flush=True)


if __name__ == "__main__":
    main()
