"""The results as markdown tables (and JSON next to them): one section per measurement."""

from __future__ import annotations

import json
import os

from bench import comm
from bench.stats import paired_ratio, ratio

TARGETS = {("autotp", "megatron"): 1.05, ("autotp", "torch_tp"): 1.0}


def _ms(s: float) -> str:
    return f"{s * 1e3:.1f}"


def _mb(b: float) -> str:
    return f"{b / 2**20:.2f}"


def _table(header: list[str], rows: list[list]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return lines + [""]


def _verdict(value: float, target: float) -> str:
    return "met" if value <= target else "not met"


def runtime_lines(rt: dict) -> list[str]:
    """Step times of every variant, ratios of medians, and the correctness checks behind them."""
    times = rt["times"]
    lines = [f"Model: {rt['shape']}. Each sample is one forward + backward (cross-entropy on full logits); "
             "the slowest rank's time. Threads per process: "
             + ", ".join(f"{n} {t}" for n, t in rt["threads"].items()) + ".", ""]
    load = rt.get("load_average")
    if load:
        lines += [f"1-minute load average over the timed rounds: {load['min']:.2f} to {load['max']:.2f} "
                  "(the benchmark's own busy processes account for about 2 on CPU; more means other work).", ""]
    rows = [[n, _ms(t["median"]), _ms(t["iqr"]), _ms(t["min"]), _ms(t["max"]), t["n"]] for n, t in times.items()]
    lines += _table(["variant", "median ms", "IQR ms", "min ms", "max ms", "samples"], rows)
    rows = []
    for other in [n for n in times if n != "autotp"]:
        r = ratio(times["autotp"], times[other])
        target = TARGETS.get(("autotp", other))
        paired = paired_ratio(rt["samples"]["autotp"], rt["samples"][other])
        rows.append([f"autotp / {other}", f"{r:.3f}", f"{paired['median']:.3f} ({paired['low']:.3f}–{paired['high']:.3f})",
                     f"{times['autotp']['min'] / times[other]['min']:.3f}",
                     f"≤ {target}" if target else "", _verdict(r, target) if target else ""])
    lines += ["Ratios: of the medians; paired, the median of the per-round ratios (each round times every "
              "variant once) with its 95% bootstrap interval, which cancels drift common to a round; of the "
              "fastest steps, the least disturbed by other work.", ""]
    lines += _table(["ratio", "of medians", "paired (95% interval)", "of minima", "target (medians)", ""], rows)
    rows = [[n, f"{c['max_rel_diff']:.1e}", "yes" if c["ok"] else "NO"] for n, c in rt.get("checks", {}).items()]
    lines += ["Checked before timing: each variant's logits against the single model's."]
    lines += _table(["variant", "max |Δ logits| (relative)", "equal"], rows)
    lines += [f"A plain `ColwiseParallel` on nanoGPT's fused `c_attn` (not timed): {rt.get('fused_colwise', '?')}.", ""]
    return lines


def _cell(step: dict, direction: str, op: str) -> str:
    e = step.get(direction, {}).get(op)
    return f"{e['count']} / {_mb(e['bytes'])}" if e else "0"


def comm_lines(shape: str, counted: dict, minimum: dict) -> list[str]:
    """Collectives per step of each variant (count / MiB) and the ratio to Megatron's minimum."""
    low = comm.totals(minimum)
    cols = [("forward", "all_reduce"), ("forward", "all_gather"), ("backward", "all_reduce"), ("backward", "all_gather")]
    rows = [["Megatron minimum (analytic)", *(_cell(minimum, d, o) for d, o in cols), "1.00", "1.00"]]
    for name, step in counted.items():
        t = comm.totals(step)
        rows.append([name, *(_cell(step, d, o) for d, o in cols),
                     f"{t['count'] / low['count']:.2f}", f"{t['bytes'] / low['bytes']:.2f}"])
    header = ["variant", "fwd all-reduce", "fwd all-gather", "bwd all-reduce", "bwd all-gather",
              "count / min", "bytes / min"]
    return [f"Model: {shape}. Cells: collectives / MiB per step (payload = the whole tensor each produces).", ""] \
        + _table(header, rows)


def memory_lines(per_rank: list[dict]) -> list[str]:
    """Per-rank bytes (the largest over ranks) against the single model's divided by tp·pp."""
    first = per_rank[0]
    split = first["tp"] * first["pp"]
    single = first["per_variant"]["single"]
    worst = {n: {k: max(r["per_variant"][n][k] for r in per_rank) for k in single}
             for n in first["per_variant"] if n != "single"}
    rows = [["single (whole model)", _mb(single["param_bytes"]), "", _mb(single["optimizer_bytes"]), "",
             _mb(single["activation_bytes"]), ""]]
    for name, m in worst.items():
        rows.append([name, _mb(m["param_bytes"]), f"{m['param_bytes'] / (single['param_bytes'] / split):.3f}",
                     _mb(m["optimizer_bytes"]), f"{m['optimizer_bytes'] / (single['optimizer_bytes'] / split):.3f}",
                     _mb(m["activation_bytes"]), f"{m['activation_bytes'] / single['activation_bytes']:.3f}"])
    header = ["variant", "params MiB/rank", f"/ (total/{split})", "AdamW state MiB/rank", f"/ (total/{split})",
              "activations MiB/rank", "/ single's"]
    lines = [f"Model: {first['shape']}, tp={first['tp']}, pp={first['pp']}. Target: params per rank ≤ 1.05 × "
             f"total/(tp·pp). Activations: bytes autograd saves for backward in one forward (parameters excluded).",
             ""] + _table(header, rows)
    if "peak_step_bytes" in single:
        lines += _table(["variant", "peak step MiB (GPU)"], [[n, _mb(max(r["per_variant"][n]["peak_step_bytes"]
                                                                       for r in per_rank))] for n in worst])
    return lines


def prep_lines(prep: dict) -> list[str]:
    """Preparation time by depth (medians, seconds) and how each phase grows with depth."""
    keys = ["export_static", "export_dynamic", "capture", "analysis", "regions", "propagate", "planning", "rewrite",
            "total"]
    header = ["layers", "params (M)", *(k.replace("_", " ") for k in keys), "total / export static"]
    rows = []
    for d in prep["depths"]:
        p = {k: v["median"] for k, v in d["phases"].items()}
        rows.append([d["layers"], f"{d['params'] / 1e6:.1f}", *(f"{p[k]:.2f}" for k in keys),
                     f"{d['ratio_to_export_static']:.2f}"])
    lines = [f"Width: {prep['shape']} (example input), tp={prep['tp']}, {prep['threads']} torch threads. "
             "Medians in seconds; total = capture + make_plan (analysis + regions + propagate + planning) + rewrite.",
             ""] + _table(header, rows)
    spread = [[d["layers"], f"{d['phases']['total']['min']:.2f}–{d['phases']['total']['max']:.2f}",
               d["phases"]["total"]["n"]] for d in prep["depths"]]
    lines += _table(["layers", "total min–max s", "runs"], spread)
    rows = [[k, f"{v['exponent']:.2f}", ", ".join(f"{s * 1e3:.0f}" for s in v["per_layer"])]
            for k, v in prep["scaling"].items()]
    lines += ["Growth with depth: exponent of a log-log fit (1 = linear) and ms added per layer between "
              "consecutive depths (constant = linear)."]
    return lines + _table(["phase", "exponent", "ms per added layer"], rows)


def pipeline_lines(pp: dict) -> list[str]:
    """The pipeline sections: skipped, with the reason, until autotp has pp."""
    lines = []
    for key, title in (("tp_pp_runtime", "tp=2 × pp=2 step time"), ("schedules", "GPipe / 1F1B schedules")):
        section = pp[key]
        lines.append(f"- {title}: " + (f"skipped: {section['skipped']}" if "skipped" in section else "see JSON"))
    return lines + [""]


def render(results: dict) -> str:
    """The whole report."""
    cfg = results["config"]
    m = results["machine"]
    lines = [f"# autotp benchmark: {results['label']}", "",
             f"Command: `{results['command']}`. Took {results['seconds']:.0f} s.",
             f"Machine: {m['cpu']}, {m['cores']} cores, {m['memory_gib']:.0f} GiB; {m['device']}; torch {m['torch']}, "
             f"Python {m['python']}. 1-minute load average {m['load_average_start']:.2f} at the start, "
             f"{m['load_average_end']:.2f} at the end. tp={cfg['tp']}, dtype {cfg['dtype']}, timed steps per variant {cfg['repeats']} "
             f"(after {cfg['warmup']} warm-up rounds).", ""]
    if "runtime" in results and results["runtime"].get("times"):
        lines += ["## 1. Runtime overhead (tp=2)", ""] + runtime_lines(results["runtime"])
    if "runtime" in results or "memory" in results:
        lines += ["## 2. Communication per training step", ""]
    if "runtime" in results:
        lines += comm_lines(results["runtime"]["shape"], results["runtime"]["comm"], results["runtime"]["comm_minimum"])
    if "memory" in results:
        mem = results["memory"][0]
        lines += comm_lines(mem["shape"], {n: v["comm"] for n, v in mem["per_variant"].items() if "comm" in v},
                            mem["comm_minimum"])
        lines += ["## 3. Memory per rank", ""] + memory_lines(results["memory"])
    if "prep" in results:
        lines += ["## 4. Preparation time", ""] + prep_lines(results["prep"])
    if "pipeline" in results:
        lines += ["## 5. Pipeline parallelism", ""] + pipeline_lines(results["pipeline"])
    return "\n".join(lines)


def write(results: dict, out_dir: str) -> tuple[str, str]:
    """Write ``<label>.md`` and ``<label>.json`` under ``out_dir``; returns their paths."""
    os.makedirs(out_dir, exist_ok=True)
    md, js = (os.path.join(out_dir, f"{results['label']}.{ext}") for ext in ("md", "json"))
    with open(js, "w") as f:  # first: a rendering error must not lose a long run's numbers
        json.dump(results, f, indent=1)
    with open(md, "w") as f:
        f.write(render(results) + "\n")
    return md, js
