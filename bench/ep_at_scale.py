"""The layout search on mixtures of experts at scale: DeepSeek-V3, Qwen3-MoE 235B-A22B and Mixtral 8x22B on 64 to
2048 H100s, each next to the layout its authors (or Megatron's MoE model zoo) published, priced by the same cost
model (no GPU needed: the models are built on meta; see ``bench.layouts_at_scale`` for how a 3-layer capture is
deepened to the real depth).

    python -m bench.ep_at_scale [--models deepseek-v3,...] [--devices 64,256,1024,2048]

Sequences of 4096 tokens (every published run below used 4096). Writes ``bench/results/ep_at_scale.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import torch

from autotp.options import Options
from autotp.planning.layout_cost import Profile
from autotp.planning.layout_search import profile_of, rank_layouts
from bench.layouts_at_scale import H100, deepen
from bench.layouts_at_scale import captured as captured_at

SEQ = 4096
RESULTS = Path(__file__).parent / "results" / "ep_at_scale.json"

CONFIGS = {
    # DeepSeek-V3's dense prefix (first_k_dense_replace=3) is left out: every captured layer is an MoE one.
    "deepseek-v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", 61, dict(
        vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
        num_attention_heads=128, num_key_value_heads=128, n_routed_experts=256, n_shared_experts=1,
        num_experts_per_tok=8, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
        v_head_dim=128, first_k_dense_replace=0, max_position_embeddings=SEQ, n_group=8, topk_group=4)),
    "qwen3-moe-235b": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", 94, dict(
        vocab_size=151936, hidden_size=4096, intermediate_size=12288, moe_intermediate_size=1536,
        num_attention_heads=64, num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
        decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=SEQ)),
    "mixtral-8x22b": ("MixtralConfig", "MixtralForCausalLM", 56, dict(
        vocab_size=32768, hidden_size=6144, intermediate_size=16384, num_attention_heads=48, num_key_value_heads=8,
        num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=SEQ)),
}
"""(config class, model class, real depth, config fields): the published configs' shapes."""

PUBLISHED = [
    ("deepseek-v3", 2048, 15360, {"tp": 1, "pp": 16, "dp": 128, "ep": 64, "dp_mode": "fsdp"},
     15360 * SEQ / (1e12 / (180e3 * 3600 / 2048)),
     "DeepSeek-V3 report: PP16 EP64 ZeRO-1 DP128 on 2048 H800, batch 15360; 180K GPU hours per trillion tokens"),
    ("deepseek-v3", 1024, 8192, {"tp": 1, "pp": 16, "dp": 64, "ep": 64, "dp_mode": "fsdp"}, None,
     "Megatron MoE model zoo (runtime.conf): TP1 PP16 EP64 on 128 nodes of 8 H100, GBS 8192, DeepEP"),
    ("qwen3-moe-235b", 256, 2048, {"tp": 2, "pp": 8, "dp": 16, "ep": 32, "dp_mode": "fsdp",
                                   "schedule": "interleaved1f1b", "virtual_stages": 4, "sequence_parallel": True},
     19.7, "Megatron MoE model zoo (Qwen3 readme): TP2 PP8 VPP4 EP32 on 256 H100, GBS 2048, 19.7 s (DeepEP)"),
    ("mixtral-8x22b", 128, 256, {"tp": 2, "pp": 8, "dp": 8, "ep": 8, "dp_mode": "fsdp", "sequence_parallel": True},
     256 * SEQ * 6 * 39e9 / (128 * 455e12),
     "Megatron MoE model zoo (runtime.conf): TP2 PP8 EP8 on 16 nodes of 8 H100, GBS 256, ~455 TFLOPS/GPU "
     "(step from 6 x 39B active parameters per token)"),
]
"""(model, devices, global batch of SEQ-token sequences, layout, published step seconds or None, source)."""

SWEEP = (64, 256, 1024, 2048)
"""Device counts the search is run at for each model (at the batch of its first published entry)."""

TPS = (1, 2, 4, 8)


def profiles(name: str, batch: int) -> list[Profile]:
    """The model's profiles at every tp in TPS (with and without sequence parallelism), at its real depth."""
    captured, layers = captured_at(CONFIGS[name]), CONFIGS[name][2]
    out = []
    for tp in TPS:
        for sp in (False, True) if tp > 1 else (False,):
            options = Options(tp=tp, sequence_parallel=sp, batch=batch, seq=SEQ)
            out.append(deepen(profile_of(captured, options, H100), layers))
    return out


def rescaled(profile: Profile, factor: float) -> Profile:
    """``profile`` for ``factor`` times its global batch at the same sequence length: every batch-dependent cost
    (FLOPs, activations, collective and boundary bytes, routed tokens) is linear in the batch; parameters and ops
    are not. Saves planning a model once per published batch."""
    scale = lambda values: tuple(v * factor for v in values)  # noqa: E731
    return dataclasses.replace(
        profile, compute=scale(profile.compute), activations=scale(profile.activations),
        boundaries=scale(profile.boundaries), recomputed=scale(profile.recomputed),
        collectives=tuple((op, nbytes * factor, unit) for op, nbytes, unit in profile.collectives),
        moe=tuple(dataclasses.replace(m, tokens=m.tokens * factor) for m in profile.moe))


def _row(p) -> dict:
    return {"layout": p.layout.label(), "ep": p.layout.ep, "step s": p.step_time, "memory GiB": p.memory / 2**30,
            "fits": p.fits, "compute s": p.compute, "tp comm s": p.tp_comm, "ep comm s": p.ep_comm,
            "bubble s": p.bubble, "p2p s": p.p2p, "dp comm s": p.dp_comm}


def best(found: list[Profile], devices: int, batch: int, fixed: dict) -> list[dict]:
    """The ranked layouts of ``devices`` devices with ``fixed`` settings, the first five."""
    # every=True: every layout priced, also those parallelize does not run yet (cp with ep, a mixed-precision fsdp
    # policy at ep above tp), to price published layouts beside ours.
    return [_row(p) for p in rank_layouts(found, devices, batch, fixed, H100, None, every=True)[:5]]


def main(argv: list[str] | None = None) -> int:
    """Price every model at every device count, and each published layout; print and write them."""
    p = argparse.ArgumentParser(prog="python -m bench.ep_at_scale", description=__doc__.splitlines()[0])
    p.add_argument("--models", default=",".join(CONFIGS))
    p.add_argument("--devices", default=",".join(map(str, SWEEP)))
    p.add_argument("--out", default=str(RESULTS))
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    results = []
    for name in args.models.split(","):
        cache: dict[int, list[Profile]] = {}
        for model, devices, batch, layout, published, source in PUBLISHED:
            if model != name:
                continue
            if not cache:
                cache[batch] = profiles(name, batch)
            base = next(iter(cache))
            found = cache.setdefault(batch, [rescaled(q, batch / base) for q in cache[base]])
            ours, theirs = best(found, devices, batch, {}), best(found, devices, batch, layout)
            tp_only = best(found, devices, batch, {"ep": 1})
            results.append({"model": name, "devices": devices, "batch": batch, "source": source,
                            "published step s": published, "ours": ours, "theirs": theirs[0] if theirs else None,
                            "ours at ep=1": tp_only[0] if tp_only else None})
            print(f"{name} {devices} H100 batch {batch}x{SEQ}: ours {ours[0]['layout']} {ours[0]['step s']:.3g} s "
                  f"{ours[0]['memory GiB']:.3g} GiB; ep=1 {tp_only[0]['layout']} {tp_only[0]['step s']:.3g} s; "
                  f"theirs {theirs[0]['layout']} {theirs[0]['step s']:.3g} s {theirs[0]['memory GiB']:.3g} GiB "
                  f"(published {'-' if published is None else f'{published:.3g} s'})", flush=True)
        batch = next(b for m, _, b, *_ in PUBLISHED if m == name)
        for devices in map(int, args.devices.split(",")):
            ours = best(cache[batch], devices, batch, {})
            if ours:
                results.append({"model": name, "devices": devices, "batch": batch, "sweep": True, "ours": ours})
                print(f"  {name} on {devices}: {ours[0]['layout']} {ours[0]['step s']:.3g} s "
                      f"{ours[0]['memory GiB']:.3g} GiB fits={ours[0]['fits']}", flush=True)
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
