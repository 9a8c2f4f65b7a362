"""Grouped-query attention above its KV heads: parameters per rank against total / tp, planned on the meta device.

    python -m bench.gqa

Llama 3 8B's shapes (hidden 4096, 32 query heads, 8 KV heads, 32 layers, vocabulary 128256) planned with
``autotp.plan`` (nothing materialised) at tp = 8, 16 and 32: at 16 and 32, tp exceeds the 8 KV heads. A rank holds
1/chunks of each split parameter (K/V: the KV heads its query heads use, tp/8 ranks per head) and every
other parameter whole (the norms). For comparison, the K/V kept whole on every rank (autotp before).
"""

from __future__ import annotations

import json
from pathlib import Path

import autotp

RESULTS = Path(__file__).parent / "results" / "gqa.json"
TPS = (8, 16, 32)


def _llama3_8b():
    import transformers

    config = transformers.LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                                      num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8)
    with autotp.empty_weights():
        return transformers.LlamaForCausalLM(config)


def per_rank(model, plan) -> dict:
    """Parameters one rank holds under ``plan``, and with chunks several ranks hold kept whole instead."""
    local = whole_kv = 0
    for name, p in model.named_parameters():
        placement = plan.placements[name]
        mine = p.numel() // placement.chunks(plan.tp) if placement.is_split else p.numel()
        local += mine
        whole_kv += p.numel() if placement.replicas != 1 else mine
    return {"local": local, "kv whole": whole_kv}


def main() -> None:
    """Plan, print the table, write ``bench/results/gqa.json``."""
    model = _llama3_8b()
    total = sum(p.numel() for p in model.parameters())
    rows = {}
    for tp in TPS:
        plan = autotp.plan(model, tp, vocab="split")
        counts = per_rank(model, plan)
        rows[tp] = {**counts, "ideal": total / tp, "ratio": counts["local"] / (total / tp),
                    "ratio kv whole": counts["kv whole"] / (total / tp),
                    "kv holders": max(p.replicas for p in plan.placements.values())}
    RESULTS.write_text(json.dumps({"total": total, "rows": rows}, indent=2) + "\n")
    print(f"Llama 3 8B shapes, {total / 1e9:.2f} B parameters")
    print("| tp | ranks per KV head | parameters per rank | / (total / tp) | K/V kept whole (before) |")
    print("|---|---|---|---|---|")
    for tp, r in rows.items():
        print(f"| {tp} | {r['kv holders']} | {r['local'] / 1e6:.1f} M | {r['ratio']:.3f} | "
              f"{r['kv whole'] / 1e6:.1f} M ({r['ratio kv whole']:.3f}) |")


if __name__ == "__main__":
    main()
