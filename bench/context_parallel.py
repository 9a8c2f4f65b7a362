"""Context parallelism: step time, peak memory, bytes saved for backward and bytes moved per rank at cp=1, 2 and 4.

    python -m bench.context_parallel [--seq 8192] [--steps 3] [--cps 0,1,2,4] [--recompute]

A Llama (4 layers, hidden 256, 8 heads over 2 KV heads, vocabulary 1024, batch 1) at ``--seq`` tokens on gloo
ranks on the CPU (one thread each): the unsharded model itself, then ``parallelize(model, cp=N, tp=1)`` at
cp=1 (one process: the captured graph, whose mask transformers builds whole), 2 and 4. Each steps AdamW
``--steps`` times after one warm-up (median step time, the slowest rank's); peak memory is the rank process's
peak resident set (each run's ranks are fresh processes, so it is that run's: model, optimizer, activations and
the Python runtime alike); saved bytes are the storages autograd keeps for backward in one forward (parameters excluded,
``bench.memory.SavedActivations``); bytes moved are what each rank's key/value gathers received (forward all-gather
and backward reduce-scatter), next to the all-gather's minimum (every other rank's KV heads, twice). ``--recompute``
adds, after each autotp run, the same run with ``recompute="blocks"`` (each block recomputed in backward, its
exchange too: the bytes received then include one more forward all-gather); autograd's saved bytes then leave out the
blocks' inputs, which checkpoint keeps itself, so the peak resident set is the figure to compare.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time

import torch

import autotp
from bench.memory import SavedActivations
from bench.ranks import run_on_ranks


def build(seed: int = 0, kv_heads: int = 2) -> torch.nn.Module:
    """The benchmark's Llama (transformers), its 8 heads over ``kv_heads`` KV heads."""
    import transformers

    torch.manual_seed(seed)
    config = transformers.LlamaConfig(vocab_size=1024, hidden_size=256, intermediate_size=512,
                                      num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=kv_heads,
                                      max_position_embeddings=1 << 17)
    return transformers.LlamaForCausalLM(config)


def logits_loss(out, y):
    """Cross-entropy of the output's logits (or the output itself) against ``y``."""
    logits = getattr(out, "logits", out)
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())


def measure(rank: int, world: int, seq: int, steps: int, cp: int, recompute: str = "none") -> dict:
    """One rank's figures at ``cp`` (0: the unsharded model itself; 1: autotp's module of it in one process)."""
    model = build()
    x = torch.randint(0, 1024, (1, seq), generator=torch.Generator().manual_seed(1))
    y = torch.randint(0, 1024, (1, seq), generator=torch.Generator().manual_seed(2))
    pm = autotp.parallelize(model, cp=cp, tp=1, example_inputs=x, recompute=recompute) if cp else model
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-4)

    def loss_of():
        return pm.loss(x, target=y, loss_fn=logits_loss) if cp else logits_loss(model(x), y)
    times = []
    for step in range(steps + 1):
        start = time.perf_counter()
        saved = SavedActivations(list(pm.parameters()))
        with saved:
            loss = loss_of()
        loss.backward()
        opt.step(), opt.zero_grad()
        if step:
            times.append(time.perf_counter() - start)
    received = sum(m.received for gm in (pm.rank_modules() if cp else ()) for name, m in gm.named_modules()
                   if name.startswith("cp_kv_")) // (steps + 1)
    c = model.config
    kv = seq * c.num_key_value_heads * (c.hidden_size // c.num_attention_heads) * 4
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    return {"step_s": statistics.median(times), "saved": saved.bytes, "received": received, "peak": peak,
            "minimum": c.num_hidden_layers * 2 * 2 * kv * (cp - 1) // cp if cp else 0, "loss": float(loss.detach())}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--cps", default="0,1,2,4", help="the runs: 0 is the unsharded model, N autotp at cp=N")
    parser.add_argument("--recompute", action="store_true", help="each autotp run again with recompute='blocks'")
    args = parser.parse_args(argv)
    print(f"Llama 4 x 256 (8 heads, 2 KV heads), batch 1 x {args.seq}, fp32, gloo on the CPU, one thread per rank")
    print("run             step s  peak RSS/rank  saved for backward/rank  KV bytes received/rank/step  "
          "all-gather minimum  loss")
    cps = [int(c) for c in args.cps.split(",")]
    runs = [(cp, rc) for cp in cps for rc in ("none", "blocks") if rc == "none" or (cp and args.recompute)]
    for cp, recompute in runs:
        ranks = run_on_ranks(measure, "cpu", [1] * max(cp, 1), args.seq, args.steps, cp, recompute,
                             start_method="spawn")
        step = max(r["step_s"] for r in ranks)
        r = ranks[0]
        label = "unsharded model" if cp == 0 else f"autotp cp={cp}" + (" rc" if recompute != "none" else "")
        peak = max(r["peak"] for r in ranks)
        print(f"{label:<15} {step:6.2f}  {peak / 2**20:9.0f} MiB  {r['saved'] / 2**20:10.1f} MiB {r['received'] / 2**20:22.2f} MiB "
              f"{r['minimum'] / 2**20:18.2f} MiB  {r['loss']:.6f}")


if __name__ == "__main__":
    main()
