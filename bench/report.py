"""The results as markdown tables (and JSON next to them): one section per measurement."""

from __future__ import annotations

import json
import os

from bench import comm
from bench.stats import paired_ratio, ratio

TARGETS = {("autotp", "megatron"): 1.02, ("autotp", "torch_tp"): 1.0}


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


def load_lines(load: dict | None) -> list[str]:
    """The machine's load over the timed rounds (other work shows there)."""
    if not load:
        return []
    return [f"1-minute load average over the timed rounds: {load['min']:.2f} to {load['max']:.2f} "
            "(the benchmark's own busy processes account for about 2 on CPU; more means other work).", ""]


def times_lines(times: dict) -> list[str]:
    """Median, spread and extremes of every variant's step time."""
    rows = [[n, _ms(t["median"]), _ms(t["iqr"]), _ms(t["min"]), _ms(t["max"]), t["n"]] for n, t in times.items()]
    return _table(["variant", "median ms", "IQR ms", "min ms", "max ms", "samples"], rows)


def _interval(paired: dict, scale: float = 1.0) -> str:
    return f"{paired['median'] * scale:.3f} ({paired['low'] * scale:.3f}–{paired['high'] * scale:.3f})"


def ratio_lines(times: dict, samples: dict, pairs: list[tuple[str, str]], targets: dict) -> list[str]:
    """Ratios a / b of medians, paired by round and of minima, for each (a, b), with targets where set."""
    rows = []
    for a, b in pairs:
        r = ratio(times[a], times[b])
        target = targets.get((a, b))
        rows.append([f"{a} / {b}", f"{r:.3f}", _interval(paired_ratio(samples[a], samples[b])),
                     f"{times[a]['min'] / times[b]['min']:.3f}",
                     f"≤ {target}" if target else "", _verdict(r, target) if target else ""])
    lines = ["Ratios: of the medians; paired, the median of the per-round ratios (each round times every "
             "variant once) with its 95% bootstrap interval, which cancels drift common to a round; of the "
             "fastest steps, the least disturbed by other work.", ""]
    return lines + _table(["ratio", "of medians", "paired (95% interval)", "of minima", "target (medians)", ""], rows)


def runtime_lines(rt: dict) -> list[str]:
    """Step times of every variant, ratios of medians, and the correctness checks behind them."""
    times = rt["times"]
    lines = [f"Model: {rt['shape']}. Each sample is one forward + backward (cross-entropy on full logits); "
             "the slowest rank's time. Threads per process: "
             + ", ".join(f"{n} {t}" for n, t in rt["threads"].items()) + ".", ""]
    lines += load_lines(rt.get("load_average")) + times_lines(times)
    lines += ratio_lines(times, rt["samples"], [("autotp", n) for n in times if n != "autotp"], TARGETS)
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


PP_TARGETS = {("autotp", "megatron_pp"): 1.05}


def _checks_lines(checks: dict) -> list[str]:
    rows = [[n, f"{c['loss']:.6f}", f"{c['reference']:.6f}", f"{c['rel_diff']:.1e}", "yes" if c["ok"] else "NO"]
            for n, c in checks.items()]
    return (["Checked before timing (that step is also a warm-up): each pipeline's full-batch loss against the "
             "single model's.", ""] + _table(["variant", "loss", "single model", "relative difference", "equal"], rows))


def _stage_text(stages: list[dict]) -> str:
    return " | ".join(f"{s['modules'][0]} .. {s['modules'][-1]}" for s in stages)


def tp_pp_lines(rt: dict) -> list[str]:
    """Item 1 at tp x pp: step times, ratios to the hand-written split, the stages and the loss checks."""
    if "skipped" in rt:
        return [f"Skipped: {rt['skipped']}.", ""]
    times = rt["times"]
    lines = [f"Model: {rt['shape']}; tp={rt['tp']} × pp={rt['pp']} = {rt['tp'] * rt['pp']} ranks of "
             f"{rt['threads']} thread each (with fewer cores than ranks they share cores, every variant alike), "
             f"schedule {rt['schedule']}, {rt['microbatches']} microbatches. A sample is one whole training step "
             "(every microbatch, forward and backward, tied-weight gradients summed); the slowest rank's time.", ""]
    lines += [f"Stages of `{n}`: {_stage_text(st)}." for n, st in rt["stages"].items()]
    if "autotp_balanced" not in rt["stages"]:
        lines += ["autotp's own split (`balance=\"both\"`) is the same, so it is not timed twice."]
    lines += [""]
    lines += load_lines(rt.get("load_average")) + times_lines(times)
    pairs = [(a, b) for a, b in (("autotp", "megatron_pp"), ("autotp", "megatron_pp_rebuilt"),
                                 ("megatron_pp_rebuilt", "megatron_pp"), ("autotp_balanced", "megatron_pp"))
             if a in times and b in times]
    return lines + ratio_lines(times, rt["samples"], pairs, PP_TARGETS) + _checks_lines(rt["checks"])


def _efficiency_row(name: str, e: dict) -> list[str]:
    return [name, e["microbatches"], f"{e['ideal']:.3f}", f"{e['vs_single']['of_medians']:.3f}",
            _interval(e["vs_single"]), f"{1 - e['vs_single']['of_medians']:.3f}", f"{1 - e['ideal']:.3f}",
            f"{e['vs_microbatched']['of_medians']:.3f}", _interval(e["vs_microbatched"])]


def schedule_lines(sc: dict, microbatches: list[int]) -> list[str]:
    """Item 5: step time of each schedule and microbatch count, and the efficiency against the ideal."""
    if "skipped" in sc:
        return [f"Skipped: {sc['skipped']}.", ""]
    lines = [f"Model: {sc['shape']}; tp=1 × pp={sc['pp']}, ranks of {sc['threads']} thread; autotp's "
             f"`balance=\"compute\"` stages: {_stage_text(sc['stages'])}. `single`: one rank steps the whole batch; "
             "`single_mb<m>`: the same in m accumulated microbatches.", ""]
    lines += load_lines(sc.get("load_average")) + times_lines(sc["times"])
    rows = []
    for schedule in ("gpipe", "1f1b"):
        for m in microbatches:
            name = f"{schedule}_m{m}"
            e = sc["efficiency"].get(name)
            rows.append(_efficiency_row(name, e) if e else [name, m, "n/a (1F1B needs m ≥ p)"] + [""] * 6)
    header = ["variant", "m", "ideal m/(m+p−1)", "efficiency (medians)", "paired (95% interval)",
              "measured bubble", "ideal bubble", "vs `single_mb<m>` (medians)", "paired (95% interval)"]
    lines += ["Efficiency = T(single) / (p · T(pipeline)); measured bubble = 1 − efficiency. Against `single_mb<m>` "
              "the cost of smaller matmuls is taken out, leaving bubble, communication, imbalance and overhead.", ""]
    return lines + _table(header, rows) + _checks_lines(sc["checks"])


def imbalance_lines(im: dict) -> list[str]:
    """The planner's stage imbalance for each balance criterion against the even split by layer count."""
    lines = [f"Model: {im['shape']} (costs at that batch), tp=1. Imbalance = max/mean over stages (1 = even); "
             "`even`: the planner's own cost model with cuts forced every n_layer/pp blocks. Parameters are counted "
             f"as held: the tied embedding/head table ({im['tied_params'] / 1e6:.1f} M) on every stage that reads it.",
             ""]
    for pp, plans in im["by_pp"].items():
        rows = [[name, " / ".join(f"{b:g}" for b in p["blocks"]), f"{p['imbalance']['compute']:.3f}",
                 f"{p['imbalance']['params']:.3f}", " / ".join(f"{f / 1e9:.1f}" for f in p["flops"]),
                 " / ".join(f"{h / 1e6:.1f}" for h in p["params"])] for name, p in plans.items()]
        lines += [f"pp={pp}:", ""] + _table(["split", "blocks per stage", "compute imbalance", "params imbalance",
                                              "GFLOP per stage (forward)", "M params per stage"], rows)
    return lines


def pipeline_lines(pp: dict, cfg: dict) -> list[str]:
    """The three pipeline measurements, each where it ran."""
    lines = []
    if "tp_pp_runtime" in pp:
        lines += ["### tp=2 × pp=2 against a hand-written pipeline split", ""] + tp_pp_lines(pp["tp_pp_runtime"])
    if "schedules" in pp:
        lines += ["### GPipe and 1F1B against the ideal bubble", ""]
        lines += schedule_lines(pp["schedules"], cfg["schedule_microbatches"])
    if "imbalance" in pp:
        lines += ["### Stage imbalance: the planner against an even split", ""] + imbalance_lines(pp["imbalance"])
    return lines


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
        lines += ["## 5. Pipeline parallelism", ""] + pipeline_lines(results["pipeline"], cfg)
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
