"""Checkpoints: peak memory per rank preparing a model at tp=2 from memory or from a checkpoint; save/load speed.

``python -m bench.checkpoint`` builds a Llama of a few hundred MB (fp32), writes it as a Hugging Face directory,
then runs three spawns of 2 gloo ranks, each a fresh pair of processes:

* ``memory``: every rank builds the full model and parallelizes it (the way without checkpoints: rank 0's
  copy is broadcast, each rank keeps its shards); then ``pm.save`` (DCP), ``pm.load`` (DCP) and the
  safetensors export are timed;
* ``safetensors`` and ``dcp``: every rank builds the model under ``autotp.empty_weights()`` (parameters on
  the meta device) and parallelizes it with ``checkpoint=`` the Hugging Face directory, or the DCP directory.

Peak resident memory is the kernel's high-water mark (``VmHWM``), reset before each phase (``clear_refs``), minus
the resident memory before the model was built (torch and transformers imported), for two phases: building the
model (under ``empty_weights`` each parameter is made, then moved to meta: the largest one exists for a moment)
and ``parallelize`` (the model still held, as a user holds it); reported per rank and as a ratio to the model's
bytes, with what stays resident once the model is dropped. The files were just written, so they are read from the page cache: the speeds are
of autotp and DCP, not of a disk. Writes ``bench/results/checkpoint-cpu.md`` and ``.json``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import tempfile
import time
from pathlib import Path

import torch

from autotp.runtime.data_parallel import local
from bench import ranks

CONFIG = dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=2, num_attention_heads=16,
              num_key_value_heads=16, tie_word_embeddings=False)
"""About 91 M parameters, 365 MB in fp32: two Llama blocks with a 32k vocabulary (embedding and head untied)."""
TP = 2


def _llama(meta: bool, layers: int):
    import transformers

    import autotp

    torch.manual_seed(0)
    config = transformers.LlamaConfig(**(CONFIG | {"num_hidden_layers": layers}))
    if meta:
        with autotp.empty_weights():
            return transformers.LlamaForCausalLM(config)
    return transformers.LlamaForCausalLM(config)


def _status(field: str) -> int:
    """A ``/proc/self/status`` memory field, in bytes."""
    text = Path("/proc/self/status").read_text()
    return int(re.search(rf"{field}:\s+(\d+) kB", text).group(1)) * 1024


def _phase(fn, base: int | None = None) -> tuple[object, dict]:
    """Run ``fn``; its wall time, and the peak resident memory above ``base`` (default: the resident memory when
    it began) while it ran."""
    gc.collect()
    base = _status("VmRSS") if base is None else base
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
    start = time.perf_counter()
    out = fn()
    seconds = time.perf_counter() - start
    return out, {"seconds": seconds, "base_mb": base / 2**20, "added_mb": (_status("VmHWM") - base) / 2**20}


def rank_body(rank: int, world: int, how: str, folder: str, layers: int) -> dict:
    """One rank of one spawn: build the model and prepare it ``how`` (memory, safetensors or dcp); measure both
    against the resident memory before the model was built."""
    import autotp

    folder = Path(folder)
    ids = torch.randint(0, 1000, (2, 16), generator=torch.Generator().manual_seed(0))
    gc.collect()
    start = _status("VmRSS")
    model, build = _phase(lambda: _llama(how != "memory", layers), start)
    source = None if how == "memory" else folder / ("hf" if how == "safetensors" else "dcp")
    pm, prep = _phase(lambda: autotp.parallelize(model, tp=TP, example_inputs=(ids,), checkpoint=source, quiet=True),
                      start)
    model = None  # the user drops the original: what the parallel module keeps alive is measured next
    gc.collect()
    out = {"build": build, "prepare": prep, "held_mb": (_status("VmRSS") - start) / 2**20,
           "local_mb": sum(local(p).numel() * p.element_size() for p in pm.parameters()) / 2**20}
    if how == "memory":
        _, out["save_dcp"] = _phase(lambda: pm.save(folder / "dcp"))
        _, out["load_dcp"] = _phase(lambda: pm.load(folder / "dcp", quiet=True))
        _, out["export_safetensors"] = _phase(lambda: pm.save(folder / "export", format="safetensors"))
    return out


def _write_hf(folder: Path, layers: int) -> float:
    """The model as a Hugging Face directory; returns its bytes in MB."""
    model = _llama(False, layers)
    model.save_pretrained(str(folder / "hf"))
    return sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20


def run(layers: int) -> dict:
    """Every spawn; the results per rank, with the model's size."""
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        model_mb = _write_hf(folder, layers)
        gc.collect()
        spawns = {how: ranks.run_on_ranks(rank_body, "cpu", [1] * TP, how, str(folder), layers)
                  for how in ("memory", "safetensors", "dcp")}
    return {"model_mb": model_mb, "layers": layers, "config": CONFIG | {"num_hidden_layers": layers}, "tp": TP,
            "spawns": spawns, "load_average": os.getloadavg()[0]}


def report(results: dict) -> str:
    """The markdown tables of ``results``."""
    model = results["model_mb"]
    lines = [f"Llama, {results['layers']} blocks, {model:.0f} MB of fp32 parameters, tp={results['tp']}, 2 gloo ranks.",
             "", "| prepared from | peak RSS added, rank 0 / rank 1 (MB) | / model bytes | building the model | "
             "parallelize | held after (MB) | parallelize time (s) |", "|---|---|---|---|---|---|---|"]
    names = {"memory": "the full model in memory (built on every rank)",
             "safetensors": "HF safetensors directory, meta model",
             "dcp": "DCP checkpoint (pm.save at tp=2), meta model"}
    for how, label in names.items():
        runs = results["spawns"][how]
        added = [max(r["build"]["added_mb"], r["prepare"]["added_mb"]) for r in runs]
        build = max(r["build"]["added_mb"] for r in runs) / model
        prep = max(r["prepare"]["added_mb"] for r in runs) / model
        lines.append(f"| {label} | {added[0]:.0f} / {added[1]:.0f} | **{max(added) / model:.2f}** | {build:.2f} | "
                     f"{prep:.2f} | {max(r['held_mb'] for r in runs):.0f} | "
                     f"{max(r['prepare']['seconds'] for r in runs):.1f} |")
    lines += ["", "| operation | time (s, max over ranks) | model MB/s | peak RSS added (MB, max) |",
              "|---|---|---|---|"]
    ops = {"save_dcp": "pm.save(DIR) (DCP, each rank its shards)", "load_dcp": "pm.load(DIR) (DCP, into the module)",
           "export_safetensors": "pm.save(DIR, format='safetensors') (gather, rank 0 writes)"}
    for key, label in ops.items():
        per_rank = [r[key] for r in results["spawns"]["memory"]]
        seconds = max(p["seconds"] for p in per_rank)
        added = max(p["added_mb"] for p in per_rank)
        lines.append(f"| {label} | {seconds:.2f} | {model / seconds:.0f} | {added:.0f} |")
    shard = results["spawns"]["memory"][0]["local_mb"]
    lines += ["", f"Each rank's parameters: {shard:.0f} MB ({shard / model:.2f} of the model). "
              f"Load average at the end: {results['load_average']:.1f}."]
    return "\n".join(lines)


def main(argv=None) -> int:
    """Run, print the tables and write them with the raw results to bench/results/checkpoint-cpu.md|json."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=CONFIG["num_hidden_layers"])
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args(argv)
    results = run(args.layers)
    text = report(results)
    print(text)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "checkpoint-cpu.md").write_text(text + "\n", encoding="utf-8")
    (out / "checkpoint-cpu.json").write_text(json.dumps(results, indent=1), encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
