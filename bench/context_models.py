"""Context parallelism on GPT-2 (its ``Conv1D`` flattens batch and sequence) and on eager attention (an explicit
``softmax(QK^T)V``): bytes saved for backward per rank, key/value bytes received per step against the method's
minimum, peak memory and step time at cp=1, 2 and 4.

    python -m bench.context_models [--seq 2048] [--batch 1] [--steps 2] [--attention sdpa|eager]

A transformers GPT-2 (4 layers, hidden 256, 8 heads, vocabulary 1024) at ``--batch`` x ``--seq`` tokens on gloo ranks
on the CPU (one thread each), on its SDPA attention (``cp_exchange='auto'``: the all-gather here) and on its eager
attention by ring (``--attention``: one of them only). At batch 1 the capture fixes the batch, so ``[B*T, C]`` is
``[T, C]``; at batch 2 the split follows the merged dim. cp=1 is autotp's module in one process (its captured graph). Saved bytes are the storages
autograd keeps for backward in one forward (parameters excluded, ``bench.memory.SavedActivations``); bytes
received are what the exchanges' modules count, next to ``planning.context_exchange.exchange_cost``'s minimum.
"""

from __future__ import annotations

import argparse
import resource
import statistics

import torch

import autotp
from autotp.planning.context_exchange import AttentionShape, exchange_cost
from bench.context_exchange import trained
from bench.ranks import run_on_ranks

RUNS = [(1, "sdpa", "auto"), (2, "sdpa", "auto"), (4, "sdpa", "auto"), (1, "eager", "auto"), (2, "eager", "ring"),
        (4, "eager", "ring")]
"""(cp, transformers' attention, cp_exchange) of each run."""


def build(seq: int, attention: str) -> torch.nn.Module:
    """The benchmark's GPT-2 on ``attention`` ("sdpa" or "eager"), its position table ``seq`` long."""
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=1024, n_embd=256, n_layer=4, n_head=8, n_positions=seq,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = transformers.GPT2LMHeadModel(config)
    model.config._attn_implementation = attention
    return model


def measure(rank: int, world: int, seq: int, steps: int, attention: str, exchange: str, batch: int = 1) -> dict:
    """One rank's figures at cp=world."""
    model = build(seq, attention)
    x = torch.randint(0, 1024, (batch, seq), generator=torch.Generator().manual_seed(1))
    y = torch.randint(0, 1024, (batch, seq), generator=torch.Generator().manual_seed(2))
    pm = autotp.parallelize(model, cp=world, tp=1, example_inputs=x, cp_exchange=exchange)
    times, saved, received, loss = trained(pm, x, y, steps)
    c = model.config
    shape = AttentionShape(batch, seq, c.n_head, c.n_head, c.n_embd // c.n_head)
    method = "all_gather" if exchange == "auto" else exchange
    return {"step_s": statistics.median(times), "saved": saved.bytes, "received": received,
            "minimum": c.n_layer * exchange_cost(method, shape, world).received if world > 1 else 0,
            "peak": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "loss": float(loss.detach())}


def main(argv=None) -> None:
    """Print one row per run of ``RUNS``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--attention", choices=("sdpa", "eager"))
    args = parser.parse_args(argv)
    print(f"GPT-2 4 x 256 (8 heads), batch {args.batch} x {args.seq}, fp32, gloo on the CPU, one thread per rank")
    print("run                      step s  peak RSS/rank  saved for backward/rank  KV bytes received/rank/step  "
          "minimum      loss")
    for cp, attention, exchange in RUNS:
        if args.attention not in (None, attention):
            continue
        ranks = run_on_ranks(measure, "cpu", [1] * cp, args.seq, args.steps, attention, exchange, args.batch,
                             start_method="spawn")
        r, step, peak = ranks[0], max(r["step_s"] for r in ranks), max(r["peak"] for r in ranks)
        label = f"cp={cp} {attention} {exchange}"
        print(f"{label:<24} {step:6.2f}  {peak / 2**20:9.0f} MiB  {r['saved'] / 2**20:18.1f} MiB "
              f"{r['received'] / 2**20:22.2f} MiB {r['minimum'] / 2**20:9.2f} MiB  {r['loss']:.6f}")


if __name__ == "__main__":
    main()
