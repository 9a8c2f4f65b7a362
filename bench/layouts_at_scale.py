"""The planner's layouts for Llama 3 8B/70B/405B and DeepSeek-V3 on 8 to 1024 H100s, next to the layouts their
authors published, each priced by the same cost model (no GPU needed: the models are built on meta).

    python -m bench.layouts_at_scale [--models llama3-8b,...]

Each model is captured at 3 layers (the width, heads and vocabulary of the real one) and its per-tp profile
(``layout_search.profile_of``: units between cuts, with their compute, parameters, activations and collectives) is
deepened to the real depth by repeating the middle layer's units, which is what the real model's units are: one
attention and one MLP unit per layer. Layouts are searched with tp up to 8 (one node: a wider tp all-reduces
over InfiniBand every layer). The published layouts are priced with the same profiles (``fixed`` to theirs, with
no memory budget, so their predicted memory shows whether our model thinks they fit). Writes
``bench/results/layouts_at_scale.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import torch

from autotp.capture import capture, example_inputs_of
from autotp.options import Options
from autotp.planning.layout_cost import Profile
from autotp.planning.layout_search import profile_of, rank_layouts
from autotp.planning.machines import MACHINES

H100 = MACHINES["h100"]
CAPTURED_LAYERS, SEQ = 3, 8192
RESULTS = Path(__file__).parent / "results" / "layouts_at_scale.json"

LLAMA = dict(num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0, max_position_embeddings=SEQ)
CONFIGS = {
    "llama3-8b": ("LlamaConfig", "LlamaForCausalLM", 32, LLAMA | dict(hidden_size=4096, intermediate_size=14336,
                                                                      num_attention_heads=32)),
    "llama3-70b": ("LlamaConfig", "LlamaForCausalLM", 80, LLAMA | dict(hidden_size=8192, intermediate_size=28672,
                                                                       num_attention_heads=64)),
    "llama3-405b": ("LlamaConfig", "LlamaForCausalLM", 126, LLAMA | dict(hidden_size=16384, intermediate_size=53248,
                                                                         num_attention_heads=128)),
    # DeepSeek-V3's dense prefix (first_k_dense_replace=3) is left out: every captured layer is an MoE one.
    "deepseek-v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", 61, dict(
        vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
        num_attention_heads=128, num_key_value_heads=128, n_routed_experts=256, n_shared_experts=1,
        num_experts_per_tok=8, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
        v_head_dim=128, first_k_dense_replace=0, max_position_embeddings=SEQ, n_group=8, topk_group=4)),
}
"""(config class, model class, real depth, config fields): the published configs' shapes."""

AC = {"recompute": "blocks"}
"""Every published Llama 3 run checkpoints activations (torchtitan: selective for 8B, full for 70B and 405B; Meta's
paper too): priced with autotp's nearest setting, each block recomputed in backward."""

PUBLISHED = [
    ("llama3-8b", 8, 16, {"tp": 1, "pp": 1, "dp": 8, "dp_mode": "fsdp"} | AC, 16 * SEQ / (8 * 5762),
     "torchtitan Table 1: FSDP 8, local batch 2, 5,762 TPS/GPU (bf16, selective AC)"),
    ("llama3-8b", 128, 256, {"tp": 1, "pp": 1, "dp": 128, "dp_mode": "fsdp"} | AC, 256 * SEQ / (128 * 5605),
     "torchtitan Table 3: FSDP 128, local batch 2, 5,605 TPS/GPU (bf16, selective AC)"),
    ("llama3-70b", 256, 512, {"tp": 8, "pp": 1, "dp": 32, "dp_mode": "fsdp"} | AC, 512 * SEQ / (256 * 829),
     "torchtitan Table 4: FSDP 32 TP 8, local batch 16, 829 TPS/GPU (Float8, full AC)"),
    ("llama3-405b", 512, 256, {"tp": 8, "pp": 8, "dp": 8, "dp_mode": "fsdp", "schedule": "interleaved1f1b"} | AC,
     256 * SEQ / (512 * 128), "torchtitan Table 5: FSDP 8 TP 8 PP 8 interleaved, 128 TPS/GPU (Float8, full AC)"),
    ("llama3-405b", 1024, 512, {"tp": 8, "pp": 16, "dp": 8, "dp_mode": "fsdp"} | AC,
     6 * 405e9 * 512 * SEQ / (1024 * 400e12),
     "Llama 3 paper's layout (TP8 PP16, DP as the devices allow; 400 TFLOPS/GPU reported at 16K GPUs)"),
    ("deepseek-v3", 1024, 1024, {"tp": 1, "pp": 16, "dp": 64, "ep": 64, "dp_mode": "fsdp"}, None,
     "DeepSeek-V3 report: PP16, EP64, ZeRO-1 DP, no TP (on 2048 H800); more in bench.ep_at_scale"),
]
"""(model, devices, global batch of SEQ-token sequences, layout, published step seconds or None, source)."""

TPS = (1, 2, 4, 8)


def _captured(name: str):
    return captured(CONFIGS[name])


def captured(entry: tuple):
    """The model of a ``CONFIGS`` entry (config class, model class, depth, config fields) captured at
    CAPTURED_LAYERS layers, built on the meta device in bf16."""
    import transformers

    config_class, model_class, _, fields = entry
    config = getattr(transformers, config_class)(num_hidden_layers=CAPTURED_LAYERS, **fields)
    with torch.device("meta"):
        model = getattr(transformers, model_class)(config).to(torch.bfloat16)
    return capture(model, example_inputs_of(model, (torch.randint(0, 1000, (2, 16)),)))


def deepen(profile: Profile, layers: int) -> Profile:
    """``profile`` of a CAPTURED_LAYERS-layer capture at ``layers`` layers: its units are the embedding, then two
    per layer (attention, MLP), then the final norm and head; the middle layer's two units are repeated."""
    first, middle = 1 + 2, slice(3, 5)
    extra = layers - CAPTURED_LAYERS

    def tiled(values, count_after):  # per-unit values: the middle layer's repeated
        values = list(values)
        return tuple(values[:first] + values[middle] * (extra + 1) + values[middle.stop:count_after])

    units = len(profile.compute)
    shifted = []
    for op, nbytes, unit in profile.collectives:
        if unit < middle.start:
            shifted.append((op, nbytes, unit))
        elif unit < middle.stop:
            shifted += [(op, nbytes, unit + 2 * k) for k in range(extra + 1)]
        else:
            shifted.append((op, nbytes, unit + 2 * extra))
    moe = []
    for layer in profile.moe:  # a mixture-of-experts layer moves with its unit, as the collectives do
        if layer.unit < middle.start:
            moe.append(layer)
        elif layer.unit < middle.stop:
            moe += [dataclasses.replace(layer, unit=layer.unit + 2 * k) for k in range(extra + 1)]
        else:
            moe.append(dataclasses.replace(layer, unit=layer.unit + 2 * extra))
    return dataclasses.replace(profile, compute=tiled(profile.compute, units), params=tiled(profile.params, units),
                               moe=tuple(moe),
                               ops=tiled(profile.ops, units), recomputed=tiled(profile.recomputed, units),
                               activations=tiled(profile.activations, units),
                               boundaries=tiled(profile.boundaries, units - 1), collectives=tuple(shifted),
                               kv=tiled(profile.kv, units) if profile.kv else ())


def profiles(name: str, batch: int, seq: int = SEQ) -> list[Profile]:
    """The model's profiles at every tp in TPS (with and without sequence parallelism), at its real depth."""
    captured, layers = _captured(name), CONFIGS[name][2]
    out = []
    for tp in TPS:
        for sp in (False, True) if tp > 1 else (False,):
            options = Options(tp=tp, sequence_parallel=sp, batch=batch, seq=seq)
            out.append(deepen(profile_of(captured, options, H100), layers))
    return out


def _row(p) -> dict:
    return {"layout": p.layout.label(), "step s": p.step_time, "memory GiB": p.memory / 2**30, "fits": p.fits,
            "compute s": p.compute, "tp comm s": p.tp_comm, "bubble s": p.bubble, "p2p s": p.p2p,
            "dp comm s": p.dp_comm}


def compare(name: str, devices: int, batch: int, layout: dict, published: float | None, source: str,
            found: list[Profile]) -> dict:
    """Our ranked layouts for ``devices`` next to the published ``layout`` priced by the same model (its
    microbatches and, where tp > 1, sequence parallelism as the model ranks them: torchtitan's and Meta's tensor
    parallelism splits the norms' sequence too)."""
    ours = rank_layouts(found, devices, batch, {}, H100, None)
    theirs = rank_layouts(found, devices, batch, layout, H100, None)
    return {"model": name, "devices": devices, "batch": batch, "source": source, "published step s": published,
            "ours": [_row(p) for p in ours[:5]], "theirs (best microbatches)": _row(theirs[0]) if theirs else None,
            "layouts priced": len(ours)}


def main(argv: list[str] | None = None) -> int:
    """Price every published configuration asked for; print and write the comparison."""
    p = argparse.ArgumentParser(prog="python -m bench.layouts_at_scale", description=__doc__.splitlines()[0])
    p.add_argument("--models", default=",".join(CONFIGS))
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    results = []
    for name in args.models.split(","):
        cache: dict[int, list[Profile]] = {}
        for model, devices, batch, layout, published, source in PUBLISHED:
            if model != name:
                continue
            if batch not in cache:
                cache[batch] = profiles(name, batch)
            result = compare(name, devices, batch, layout, published, source, cache[batch])
            results.append(result)
            best, theirs = result["ours"][0], result["theirs (best microbatches)"]
            print(f"{name} on {devices} H100s, batch {batch}x{SEQ}: ours {best['layout']} {best['step s']:.3g} s "
                  f"{best['memory GiB']:.3g} GiB fits={best['fits']}; theirs {theirs['layout']} "
                  f"{theirs['step s']:.3g} s {theirs['memory GiB']:.3g} GiB (published "
                  f"{'-' if published is None else f'{published:.3g} s'})", flush=True)
    RESULTS.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
