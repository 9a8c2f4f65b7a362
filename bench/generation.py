"""Generation: autotp at tp=2 (two processes, one thread each) against ``model.generate`` in one process.

    python -m bench.generation [--rounds 3] [--new 32] [--prompt 64]

A Llama of about 400 MB in float32 (hidden 1024, 6 layers, 16 query and 4 KV heads, MLP 2816, vocabulary 16000,
random weights: decoding one token reads every weight once, as in real serving). For batch 1 and 8, each side
generates greedily from the same prompts: prefill time is ``generate(max_new_tokens=1)``; decode tokens/s is
``batch * (new - 1)`` over the rest of a ``generate(max_new_tokens=new)`` (its time minus the prefill's).
Both sides' tokens are checked equal. The single process uses transformers' own dynamic cache; autotp's ranks
each hold their split of the KV cache, whose bytes are reported against the single cache's. The single process runs
first, then the two ranks (the machine's two cores); each reports the median of its rounds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

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


def _measure(generate, args) -> dict:
    """Prefill seconds and decode tokens/s per batch (medians over the rounds), and the tokens made."""
    found = {}
    for batch in BATCHES:
        ids = _prompts(batch, args.prompt)
        generate(ids, max_new_tokens=2)  # warm-up: the first call captures (autotp) or allocates
        prefill, total = [], []
        for _ in range(args.rounds):
            prefill.append(_timed(generate, ids, 1)[0])
            seconds, out = _timed(generate, ids, args.new)
            total.append(seconds)
        p, t = statistics.median(prefill), statistics.median(total)
        found[batch] = {"prefill_s": p, "decode_tokens_per_s": batch * (args.new - 1) / (t - p),
                        "tokens": out.tolist(), "prefill_samples": prefill, "total_samples": total}
    return found


def single(rank: int, world: int, args) -> dict:
    """``model.generate`` with its dynamic cache, one process, one thread."""
    model = build()
    with torch.inference_mode():
        found = _measure(lambda ids, max_new_tokens: model.generate(ids, max_new_tokens=max_new_tokens,
                                                                    do_sample=False), args)
        ids = _prompts(1, args.prompt)
        out = model.generate(ids, max_new_tokens=args.new, do_sample=False, return_dict_in_generate=True)
    cache = out.past_key_values
    found["cache_bytes"] = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
    found["params_bytes"] = sum(p.numel() * p.element_size() for p in model.parameters())
    return found


def parallel(rank: int, world: int, args) -> dict:
    """autotp at tp=``world``: ``pm.generate`` with the sharded KV cache."""
    import autotp

    model = build()
    pm = autotp.parallelize(model, tp=world, example_inputs=(_prompts(1, 8),), quiet=True)
    found = _measure(lambda ids, max_new_tokens: pm.generate(ids, max_new_tokens=max_new_tokens,
                                                             do_sample=False), args)
    # The cache the single process held after generating new tokens from a prompt of one sequence (its last
    # token is never written), against this rank's split of the same length.
    mine, whole = pm.generation.cached.cache_bytes(1, args.prompt + args.new - 1)
    found["cache_bytes"], found["whole_cache_bytes"] = mine, whole
    found["params_bytes"] = sum(p.numel() * p.element_size() for p in pm.parameters())
    return found


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--new", type=int, default=32, help="new tokens per generate")
    parser.add_argument("--prompt", type=int, default=64, help="prompt length")
    args = parser.parse_args(argv)
    one = ranks.run_on_ranks(single, "cpu", [1], args)[0]
    two = ranks.run_on_ranks(parallel, "cpu", [1, 1], args)[0]
    report = {"args": vars(args), "single": one, "tp2": two, "rows": []}
    for batch in BATCHES:
        a, b = one[str(batch)], two[str(batch)]
        row = {"batch": batch, "same_tokens": a["tokens"] == b["tokens"],
               "decode_single": a["decode_tokens_per_s"], "decode_tp2": b["decode_tokens_per_s"],
               "decode_ratio": b["decode_tokens_per_s"] / a["decode_tokens_per_s"],
               "prefill_single_s": a["prefill_s"], "prefill_tp2_s": b["prefill_s"],
               "prefill_ratio": a["prefill_s"] / b["prefill_s"]}
        report["rows"].append(row)
        print(f"batch {batch}: decode {row['decode_single']:.1f} -> {row['decode_tp2']:.1f} tokens/s "
              f"({row['decode_ratio']:.2f}x), prefill {row['prefill_single_s'] * 1e3:.0f} -> "
              f"{row['prefill_tp2_s'] * 1e3:.0f} ms ({row['prefill_ratio']:.2f}x), same tokens: {row['same_tokens']}")
    print(f"KV cache per rank {two['cache_bytes']} B, single process {one['cache_bytes']} B "
          f"(whole, autotp's layout: {two['whole_cache_bytes']} B); parameters per rank {two['params_bytes']} B "
          f"of {one['params_bytes']} B")
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
