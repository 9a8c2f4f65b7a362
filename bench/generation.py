"""Generation: autotp at tp=2 (two processes, one thread each) against ``model.generate`` in one process.

    python -m bench.generation [--rounds 5] [--new 32] [--prompt 64] [--vocab split]

A Llama of about 400 MB in float32 (hidden 1024, 6 layers, 16 query and 4 KV heads, MLP 2816, vocabulary 16000,
random weights: decoding one token reads every weight once, as in real serving). For batch 1 and 8, each side
generates greedily from the same prompts: prefill time is ``generate(max_new_tokens=1)``; decode tokens/s is
``batch * (new - 1)`` over the rest of a ``generate(max_new_tokens=new)`` (its time minus the prefill's).
Both sides' tokens are checked equal. The single process uses transformers' own dynamic cache; autotp's ranks
each hold their split of the KV cache, whose bytes are reported against the single cache's. Rounds alternate
between the sides in one spawn (rank 0 runs the single process while rank 1 waits in a barrier), so both meet the
same load on a shared machine; the medians of each side and of the per-round ratios are reported.

autotp's ranks talk over shared memory during generation (``runtime.shared_memory``); each round also times the
same steps talking over the parallel module's gloo group (``tp_gloo``), for comparison under the same load. The run
first measures one collective of a decode step (an all-reduce of ``hidden`` floats) on both transports: back to
back, and after half a millisecond of compute (what a decode step does between its collectives).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

from autotp.capture.core.kv_cache import output_cache
from autotp.runtime.data_parallel import local
from bench import ranks

RESULTS = Path(__file__).parent / "results" / "generation.json"
BATCHES = (1, 8)


def build():
    """The benchmark's Llama (seeded: every process builds the same weights)."""
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=16000, hidden_size=1024, intermediate_size=2816,
                                      num_hidden_layers=6, num_attention_heads=16, num_key_value_heads=4)
    return transformers.LlamaForCausalLM(config).eval()


def _prompts(batch: int, length: int) -> torch.Tensor:
    return torch.randint(0, 16000, (batch, length), generator=torch.Generator().manual_seed(batch))


def _timed(generate, ids, new: int) -> tuple[float, torch.Tensor]:
    start = time.perf_counter()
    out = generate(ids, max_new_tokens=new)
    return time.perf_counter() - start, out


def _one_round(generate, ids, new: int) -> dict:
    """Prefill seconds, decode tokens/s, and the tokens of one timed pair of generate calls."""
    prefill = _timed(generate, ids, 1)[0]
    total, out = _timed(generate, ids, new)
    return {"prefill_s": prefill, "decode_tokens_per_s": ids.shape[0] * (new - 1) / (total - prefill),
            "tokens": out.tolist()}


def _median_ms(run, rounds: int = 200) -> float:
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times[rounds // 10:]) * 1e3


def latency(comms: dict, hidden: int = 1024) -> dict:
    """Milliseconds per all-reduce of ``hidden`` floats on each communicator: back to back, and the all-reduce
    alone after about 0.5 ms of compute (a 1024 x 2048 matrix-vector product, three times)."""
    x, w = torch.randn(1, hidden), torch.randn(2 * hidden, hidden)
    found = {}
    for name, comm in comms.items():
        found[f"{name}_back_to_back_ms"] = _median_ms(lambda: comm.all_reduce(x))
        after = []

        def computed_then_reduced():
            for _ in range(3):
                torch.mv(w, x[0])
            start = time.perf_counter()
            comm.all_reduce(x)
            after.append(time.perf_counter() - start)

        _median_ms(computed_then_reduced)
        found[f"{name}_after_compute_ms"] = statistics.median(after[20:]) * 1e3
    return found


def paired(rank: int, world: int, args) -> dict:
    """Rounds alternating between ``model.generate`` on rank 0 alone (its dynamic cache, one thread; the other
    rank waits in a barrier) and ``pm.generate`` at tp=``world``, so that both sides meet the same machine load."""
    import torch.distributed as dist

    import autotp
    from autotp.rewrite.cache_layout import build_cache_steps
    from autotp.runtime.generation import Generation
    from autotp.runtime.shared_memory import same_host

    if args.bind_cores:  # each rank on its own core, as serving engines bind their CPU workers (both sides alike)
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[rank % len(os.sched_getaffinity(0))]})
    model = build()
    model.generation_config.eos_token_id = None  # every sequence runs all the new tokens on both sides
    pm = autotp.parallelize(model, tp=world, example_inputs=(_prompts(1, 8),), vocab=args.vocab, quiet=True)
    shared = same_host(pm.comm)
    found = {"latency": latency({"gloo": pm.comm, "shared_memory": shared})}
    pm.generation.comm = shared  # before the first generate: the tp side talks over shared memory
    over_gloo = Generation(model, build_cache_steps)  # the same steps, built over the module's gloo group
    over_gloo.comm = pm.comm

    def single(ids, max_new_tokens):
        with torch.inference_mode():
            return model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)

    def parallel(ids, max_new_tokens):
        return pm.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)

    def parallel_gloo(ids, max_new_tokens):
        given = {"max_new_tokens": max_new_tokens, "do_sample": False, "return_dict_in_generate": False,
                 "output_logits": False}
        return over_gloo.generate(pm, ids, None, given)

    for batch in BATCHES:
        ids = _prompts(batch, args.prompt)
        if rank == 0:
            single(ids, 2)  # warm-up
        parallel(ids, 2)  # warm-up (the first call captures autotp's generation steps)
        parallel_gloo(ids, 2)
        rounds = []
        for _ in range(args.rounds):
            dist.barrier()
            one = _one_round(single, ids, args.new) if rank == 0 else None
            dist.barrier()
            rounds.append({"single": one, "tp": _one_round(parallel, ids, args.new),
                           "tp_gloo": _one_round(parallel_gloo, ids, args.new)})
        found[batch] = rounds
    if rank == 0:
        with torch.inference_mode():
            out = model.generate(_prompts(1, args.prompt), max_new_tokens=args.new, do_sample=False,
                                 return_dict_in_generate=True)
        found["single_cache_bytes"] = sum(t.numel() * t.element_size() for layer in output_cache(out).layers
                                          for t in (layer.keys, layer.values))
    # This rank's split of a cache as long as the one the single process held after the same generation (its
    # last token is never written).
    found["cache_bytes"], found["whole_cache_bytes"] = pm.generation.cached.cache_bytes(1, args.prompt + args.new - 1)
    found["params_bytes"] = sum(local(p).numel() * p.element_size() for p in pm.parameters())
    found["model_params_bytes"] = sum(p.numel() * p.element_size() for p in model.parameters())
    return found


def _summary(rounds: list[dict], batch: int) -> dict:
    """Medians over the rounds of each side, and of the per-round ratios; the best round of each side."""
    median = statistics.median
    one = [r["single"] for r in rounds]
    tp = [r["tp"] for r in rounds]
    gloo = [r["tp_gloo"] for r in rounds]
    same = all(a["tokens"] == b["tokens"] == c["tokens"] for a, b, c in zip(one, tp, gloo))
    return {"batch": batch, "same_tokens": same,
            "decode_tp2_gloo": median(c["decode_tokens_per_s"] for c in gloo),
            "decode_ratio_gloo": median(c["decode_tokens_per_s"] / a["decode_tokens_per_s"] for a, c in zip(one, gloo)),
            "prefill_tp2_gloo_s": median(c["prefill_s"] for c in gloo),
            "decode_single": median(a["decode_tokens_per_s"] for a in one),
            "decode_tp2": median(b["decode_tokens_per_s"] for b in tp),
            "decode_ratio": median(b["decode_tokens_per_s"] / a["decode_tokens_per_s"] for a, b in zip(one, tp)),
            "decode_ratio_best": max(b["decode_tokens_per_s"] for b in tp) / max(a["decode_tokens_per_s"] for a in one),
            "prefill_single_s": median(a["prefill_s"] for a in one),
            "prefill_tp2_s": median(b["prefill_s"] for b in tp),
            "prefill_ratio": median(a["prefill_s"] / b["prefill_s"] for a, b in zip(one, tp))}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--new", type=int, default=32, help="new tokens per generate")
    parser.add_argument("--prompt", type=int, default=64, help="prompt length")
    # A decode step reads the LM head for every token: split, each rank reads half of it (the cost model's
    # default prices a training step at the example's shape, and keeps this one whole).
    parser.add_argument("--vocab", default="split", choices=["split", "whole", "auto"],
                        help="the plan's vocabulary choice (default split)")
    parser.add_argument("--bind-cores", action="store_true", help="pin rank r to the r-th core (both sides)")
    args = parser.parse_args(argv)
    found = ranks.run_on_ranks(paired, "cpu", [1, 1], args)[0]
    report = {"args": vars(args), "rounds": {b: found[str(b)] for b in BATCHES}, "rows": []}
    for batch in BATCHES:
        row = _summary(found[str(batch)], batch)
        report["rows"].append(row)
        print(f"batch {batch}: decode {row['decode_single']:.1f} -> {row['decode_tp2']:.1f} tokens/s (ratio "
              f"{row['decode_ratio']:.2f}x, best rounds {row['decode_ratio_best']:.2f}x), prefill "
              f"{row['prefill_single_s'] * 1e3:.0f} -> {row['prefill_tp2_s'] * 1e3:.0f} ms "
              f"({row['prefill_ratio']:.2f}x), same tokens: {row['same_tokens']}; over gloo: decode "
              f"{row['decode_tp2_gloo']:.1f} tokens/s ({row['decode_ratio_gloo']:.2f}x), prefill "
              f"{row['prefill_tp2_gloo_s'] * 1e3:.0f} ms")
    report["latency"] = found["latency"]
    print("one all-reduce of 1024 floats: " + ", ".join(f"{k} {v:.3f}" for k, v in found["latency"].items()))
    for key in ("single_cache_bytes", "cache_bytes", "whole_cache_bytes", "params_bytes", "model_params_bytes"):
        report[key] = found[key]
    print(f"KV cache per rank {found['cache_bytes']} B, single process {found['single_cache_bytes']} B; parameters "
          f"per rank {found['params_bytes']} B of {found['model_params_bytes']} B")
    for rounds in report["rounds"].values():  # the tokens were compared above; the file keeps the timings
        for pair in rounds:
            for side in pair.values():
                side.pop("tokens", None)
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
