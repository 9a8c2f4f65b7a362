"""Planning time: CPU seconds and peak memory of ``autotp.plan`` on meta models, against depth and for big configs.

    python -m bench.planning_time                       # depth tables (Llama 3 8B, DeepSeek-V3 widths), big configs
    python -m bench.planning_time --depths 2,8,32 --full  # also the full capture (no stamping), for comparison
    python -m bench.planning_time --configs deepseek-v3 --depths ''

Every measurement runs in a fresh process (peak RSS is per process): imports first, then CPU time
(``time.process_time``, not wall time: the machine is shared) of building the meta model from its config,
capturing it and planning. Writes ``bench/results/planning_time.json`` and the tables into docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

LLAMA3_8B = {
    "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
    "num_hidden_layers": 32, "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": False, "hidden_act": "silu",
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
}
"""Meta-Llama-3.1-8B's config.json (the fields the model reads)."""

DEEPSEEK_V3 = {
    "model_type": "deepseek_v3", "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
    "num_hidden_layers": 61, "first_k_dense_replace": 3, "n_routed_experts": 256, "n_shared_experts": 1,
    "num_experts_per_tok": 8, "n_group": 8, "topk_group": 4, "norm_topk_prob": True, "routed_scaling_factor": 2.5,
    "num_attention_heads": 128, "num_key_value_heads": 128, "kv_lora_rank": 512, "q_lora_rank": 1536,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "vocab_size": 129280,
    "max_position_embeddings": 163840, "rms_norm_eps": 1e-6, "rope_theta": 10000, "tie_word_embeddings": False,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
}
"""deepseek-ai/DeepSeek-V3's config.json (the fields the model reads)."""

GEMMA3_27B = {
    "model_type": "gemma3_text", "hidden_size": 5376, "intermediate_size": 21504, "num_attention_heads": 32,
    "num_key_value_heads": 16, "head_dim": 128, "num_hidden_layers": 62, "vocab_size": 262208,
    "sliding_window": 1024, "query_pre_attn_scalar": 168, "max_position_embeddings": 131072, "rms_norm_eps": 1e-6,
    "hidden_activation": "gelu_pytorch_tanh",
}
"""google/gemma-3-27b's text config (the fields that size it): five sliding-window layers, then a global one."""

GEMMA2_27B = {
    "model_type": "gemma2", "hidden_size": 4608, "intermediate_size": 36864, "num_attention_heads": 32,
    "num_key_value_heads": 16, "head_dim": 128, "num_hidden_layers": 46, "vocab_size": 256000,
    "sliding_window": 4096, "query_pre_attn_scalar": 144, "max_position_embeddings": 8192, "rms_norm_eps": 1e-6,
    "hidden_activation": "gelu_pytorch_tanh",
}
"""google/gemma-2-27b's config (the fields that size it): sliding-window and global layers alternate."""

CONFIGS = {
    "llama3-8b": (LLAMA3_8B, 8, 4),
    "llama3-70b": (LLAMA3_8B | {"hidden_size": 8192, "intermediate_size": 28672, "num_attention_heads": 64,
                                "num_hidden_layers": 80}, 8, 4),
    "llama3-405b": (LLAMA3_8B | {"hidden_size": 16384, "intermediate_size": 53248, "num_attention_heads": 128,
                                 "num_hidden_layers": 126}, 8, 4),
    "deepseek-v3": (DEEPSEEK_V3, 8, 4),
    "gemma2-27b": (GEMMA2_27B, 8, 2),
    "gemma3-27b": (GEMMA3_27B, 8, 2),
}
"""Name -> config, tp, pp."""

_CHILD = r"""
import json, resource, sys, time
config, tp, pp, full = json.loads(sys.argv[1])
import autotp, torch, transformers
from autotp.capture import capture, capture_repeated
from autotp.options import Options
from autotp.planning.planner import make_plan
from autotp.capture.core.examples import example_inputs_of
from autotp.tools.model_spec import build_model, parse_spec
start = time.process_time()
path = sys.argv[2]
model = build_model(parse_spec("hf:" + path))
built = time.process_time()
captured = (capture if full else capture_repeated)(model, example_inputs_of(model, None))
caught = time.process_time()
plan = make_plan(captured, Options(tp=tp, pp=pp))
done = time.process_time()
print(json.dumps({"build_s": built - start, "capture_s": caught - built, "plan_s": done - caught,
                  "total_s": done - start, "nodes": len(captured.graph.nodes), "stages": len(plan.stages),
                  "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def measure(config: dict, tp: int, pp: int, full: bool, folder: Path) -> dict:
    """One plan in a fresh process: CPU seconds per phase, graph nodes, peak RSS."""
    path = folder / "config.json"
    path.write_text(json.dumps(config))
    out = subprocess.run([sys.executable, "-c", _CHILD, json.dumps([config, tp, pp, full]), str(path)],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


DEPTH_STYLES = {
    "llama": lambda d: LLAMA3_8B | {"num_hidden_layers": d},
    "deepseek": lambda d: DEEPSEEK_V3 | {"num_hidden_layers": d, "first_k_dense_replace": min(3, d - 1)},
}
"""Depth-table styles: Llama 3 8B's widths, and DeepSeek-V3's (its first three blocks dense, the rest mixtures of
experts; fewer dense blocks when shallower, so that every depth has one)."""


_STYLE_NAMES = {"llama": "Llama 3 8B's widths", "deepseek": "DeepSeek-V3's widths (the first min(3, layers - 1) "
                "blocks dense, the rest mixtures of 256 experts)"}


def _depth_rows(rows: list[dict], style: str) -> list[str]:
    rows = [r for r in rows if r["model"].startswith(f"{style} widths")]
    if not rows:
        return []
    out = [f"Depth, {_STYLE_NAMES[style]}, `num_hidden_layers` varied (tp=8 pp=4):", "",
           "| layers | build s | capture s | plan s | plan s per layer | total s | graph nodes | peak RSS MiB |",
           "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    out += [f"| {r['layers']} | {r['build_s']:.2f} | {r['capture_s']:.2f} | {r['plan_s']:.2f} | "
            f"{r['plan_s'] / r['layers']:.3f} | {r['total_s']:.2f} | {r['nodes']} | {r['peak_rss_mib']:.0f} |"
            for r in rows]
    return out + [""]


def markdown(rows: list[dict], load: tuple[float, float]) -> str:
    """The depth tables and the big configs' table, with the machine's load while they ran."""
    out = [f"Measured by `python -m bench.planning_time` (load average {load[0]:.1f} at the start, {load[1]:.1f} at "
           "the end, on this shared machine: CPU seconds, not wall time, but a loaded machine still slows them).", ""]
    for style in DEPTH_STYLES:
        out += _depth_rows(rows, style)
    big = [r for r in rows if r["model"] in CONFIGS]
    if big:
        out += ["Big configs (tp=8, pp=4):", "",
                "| model | layers | build s | capture s | plan s | total s | capture + plan s | peak RSS MiB |",
                "|---|---:|---:|---:|---:|---:|---:|---:|"]
        out += [f"| {r['model']} | {r['layers']} | {r['build_s']:.2f} | {r['capture_s']:.2f} | {r['plan_s']:.2f} | "
                f"{r['total_s']:.2f} | {r['capture_s'] + r['plan_s']:.2f} | {r['peak_rss_mib']:.0f} |" for r in big]
    return "\n".join(out).rstrip() + "\n"


BEGIN, END = "<!-- planning_time: begin -->", "<!-- planning_time: end -->"
"""Where ``--doc`` writes the tables: the text between these markers is replaced."""


def write_doc(path: Path, text: str) -> None:
    """Replace the text between ``BEGIN`` and ``END`` in ``path`` with ``text``."""
    doc = path.read_text()
    if BEGIN not in doc or END not in doc:
        raise SystemExit(f"{path} has no {BEGIN} ... {END} section to write the tables into")
    head, rest = doc.split(BEGIN, 1)
    path.write_text(head + BEGIN + "\n" + text + END + rest.split(END, 1)[1])


def main(argv: list[str] | None = None) -> int:
    import os
    import tempfile

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--depths", default="2,4,8,16,32,64,126", help="layers of the Llama 3 8B-shaped depth table")
    p.add_argument("--deepseek-depths", default="2,4,8,16,32,64,126",
                   help="layers of the DeepSeek-V3-shaped depth table")
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"big configs to plan ({', '.join(CONFIGS)})")
    p.add_argument("--full", action="store_true", help="also plan from the full capture (no stamped blocks)")
    p.add_argument("-o", "--output", default="bench/results/planning_time.json")
    p.add_argument("--doc", default="docs/BENCHMARKS.md",
                   help=f"write the tables into this file, between {BEGIN} and {END} ('' for none)")
    args = p.parse_args(argv)
    rows = []
    modes = (False, True) if args.full else (False,)
    start_load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        jobs = [(f"{style} widths, {d} layers", DEPTH_STYLES[style](int(d)), 8, 4)
                for style, depths in (("llama", args.depths), ("deepseek", args.deepseek_depths))
                for d in filter(None, depths.split(","))]
        jobs += [(name, *CONFIGS[name]) for name in filter(None, args.configs.split(","))]
        for name, config, tp, pp in jobs:
            for full in modes:
                row = {"model": name, "layers": config["num_hidden_layers"], "tp": tp, "pp": pp,
                       "capture": "full" if full else "stamped", "load": os.getloadavg()[0],
                       **measure(config, tp, pp, full, Path(tmp))}
                rows.append(row)
                print(json.dumps(row), flush=True)
    Path(args.output).write_text(json.dumps(rows, indent=1))
    if args.doc:
        write_doc(Path(args.doc), markdown([r for r in rows if r["capture"] == "stamped"],
                                           (start_load, os.getloadavg()[0])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
