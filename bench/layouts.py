"""Every layout of 4 processes, measured next to the planner's prediction.

    python -m bench.layouts [--steps 5] [--models deep-narrow,wide-shallow,moe]

For each model (a deep-narrow GPT, a wide-shallow GPT, a small Mixtral mixture of experts), the layout search
(``autotp.planning.layout_search``) prices every valid layout of 4 devices on this CPU machine (tp, pp, dp, dp
mode, schedule, microbatches, sequence parallelism); then 4 gloo ranks (one thread each) run every one of them,
``pm.step`` on each replica's slice of the global batch followed by AdamW, and record the median step time
(``pm.step`` only, a barrier before each) and the peak memory of the fullest rank: its parameters and AdamW
moments, plus the rise of its resident set (VmHWM, reset before the timed steps) over what it held before them.
Reported: Spearman's rank correlation of predicted and measured step time (and memory), and the chosen layout's
measured time against the best measured. Writes ``bench/results/layouts.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

import autotp
from autotp.capture import capture, example_inputs_of
from autotp.options import Options
from autotp.planning.layout_search import search_layouts
from autotp.planning.machines import CLUSTERS, Cluster
from autotp.planning.pricing import Machine
from bench.ranks import run_on_ranks
from examples.gpt import build_gpt

WORLD, BATCH, SEQ, VOCAB = 4, 8, 32, 256
RESULTS = Path(__file__).parent / "results" / "layouts.json"


def _mixtral():
    import transformers

    config = transformers.MixtralConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                                        num_attention_heads=4, num_key_value_heads=4, num_local_experts=4,
                                        num_experts_per_tok=2, max_position_embeddings=64)
    return transformers.MixtralForCausalLM(config)


MODELS = {
    "deep-narrow": lambda: build_gpt(n_layer=8, n_head=4, n_embd=64, vocab_size=VOCAB, block_size=SEQ),
    "wide-shallow": lambda: build_gpt(n_layer=2, n_head=8, n_embd=384, vocab_size=VOCAB, block_size=SEQ),
    "moe": _mixtral,
}
"""Three shapes: many thin blocks (pipelines have room), few wide ones (tensor parallelism has work to divide),
and experts (parameters large against their compute)."""


def _batch(seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(seed))


def _model(name: str):
    torch.manual_seed(0)
    return MODELS[name]()


def predictions(name: str, cluster: Cluster = CLUSTERS["cpu"]) -> list:
    """Every layout of WORLD devices for model ``name``, priced on ``cluster``, best first."""
    model = _model(name)
    captured = capture(model, example_inputs_of(model, (_batch(1),)))
    return list(search_layouts(captured, WORLD, Options(), {}, cluster).ranked)


def _median_ms(fn, repeats: int = 20) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times[3:]) * 1e3


def calibrate(rank: int, world: int) -> dict:
    """On WORLD ranks at once (the load the layouts run under): a matmul's rate, an eager op's cost (a narrow
    GPT's forward and backward over 3x its graph's ops) and a two-rank gloo all-reduce's time at 4 KiB and 1 MiB."""
    x, w = torch.randn(256, 256), torch.randn(256, 1024)
    gflops = 2 * 256 * 256 * 1024 / _median_ms(lambda: x @ w) / 1e6
    torch.manual_seed(0)
    gpt, ids = build_gpt(n_layer=8, n_head=4, n_embd=64, vocab_size=VOCAB, block_size=SEQ), _batch(1)[:1, :8]
    ops = sum(n.op == "call_function" for n in capture(gpt, example_inputs_of(gpt, (ids,))).module.graph.nodes)
    op_ms = _median_ms(lambda: gpt(ids).sum().backward()) / (3 * ops)
    pair = [dist.new_group([2 * i, 2 * i + 1]) for i in range(world // 2)][rank // 2]
    small, large = torch.zeros(1024), torch.zeros(1 << 18)
    dist.barrier()
    small_ms = _median_ms(lambda: dist.all_reduce(small, group=pair))
    large_ms = _median_ms(lambda: dist.all_reduce(large, group=pair))
    return {"matmul GFLOP/s": gflops, "op us": op_ms * 1e3, "all_reduce 4 KiB ms": small_ms,
            "all_reduce 1 MiB ms": large_ms}


def measured_cluster(cal: dict) -> Cluster:
    """This machine as the bench runs it (WORLD ranks on its cores, with whatever else runs), from ``calibrate``:
    per-rank compute and op cost, and a two-rank all-reduce's latency and bandwidth (2(n-1)/n = 1 at n=2)."""
    bandwidth = (1 << 20) / max(cal["all_reduce 1 MiB ms"] - cal["all_reduce 4 KiB ms"], 1e-3) * 1e3
    machine = Machine("CPU over gloo, as measured", cal["matmul GFLOP/s"] * 1e9, bandwidth,
                      cal["all_reduce 4 KiB ms"] / 1e3, cal["op us"] / 1e6)
    return Cluster("cpu-measured", f"{WORLD} gloo ranks on this CPU, calibrated under the bench's load", machine,
                   machine, 1 << 30, None)


def _status(field: str) -> int:
    """A field of /proc/self/status in bytes (VmRSS, VmHWM)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def _state_bytes(pm) -> int:
    """This rank's parameters and AdamW's two moments (its local shards under fsdp)."""
    local = [p.to_local() if hasattr(p, "to_local") else p for p in pm.parameters()]
    return 3 * sum(p.numel() * p.element_size() for p in local)


def _measure(pm, steps: int) -> dict:
    """Median ``pm.step`` seconds over ``steps`` steps after two warm-up ones, and the peak memory."""
    x, y = _batch(2), _batch(3)
    rows = slice(pm.dp_rank * BATCH // pm.dp_size, (pm.dp_rank + 1) * BATCH // pm.dp_size)
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-4)
    times = []
    for i in range(2 + steps):
        if i == 2:  # the moments exist now; the rise over this resident set is the step's own memory
            Path("/proc/self/clear_refs").write_text("5")
            before = _status("VmRSS")
        dist.barrier()
        start = time.perf_counter()
        pm.step(x[rows], target=y[rows])
        times.append(time.perf_counter() - start)
        opt.step()
        opt.zero_grad()
    return {"time": statistics.median(times[2:]), "memory": _state_bytes(pm) + max(0, _status("VmHWM") - before)}


def measure_all(rank: int, world: int, name: str, layouts: list[dict], steps: int) -> list:
    """On each rank: parallelize model ``name`` at every layout and measure it; the slowest rank's time and the
    fullest rank's memory per layout (on rank 0)."""
    out = []
    for settings in layouts:
        pm = autotp.parallelize(_model(name), example_inputs=(_batch(1),), **settings)
        mine = _measure(pm, steps)
        everyone = [None] * world
        dist.all_gather_object(everyone, mine)
        out.append({"time": max(r["time"] for r in everyone), "memory": max(r["memory"] for r in everyone)})
        if rank == 0:
            print(f"  {name} {len(out)}/{len(layouts)} {settings}: {out[-1]['time'] * 1e3:.1f} ms", flush=True)
        del pm
    return out


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman's rank correlation (ties take their mean rank)."""
    def ranks(v):
        order = sorted(range(len(v)), key=lambda i: v[i])
        out = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                out[order[k]] = (i + j) / 2
            i = j + 1
        return out
    ra, rb = ranks(a), ranks(b)
    ma, mb = statistics.mean(ra), statistics.mean(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    return cov / (sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb)) ** 0.5


def _settings(p) -> dict:
    return {k: getattr(v, "value", v) for k, v in p.layout.settings().items()}


def run_model(name: str, steps: int, cluster: Cluster) -> dict:
    """Predict (on ``cluster``), measure and compare every layout of model ``name``."""
    ranked = predictions(name, cluster)
    measured = run_on_ranks(measure_all, "cpu", [1] * WORLD, name, [_settings(p) for p in ranked], steps)[0]
    rows = [{"layout": p.layout.label(), "predicted ms": p.step_time * 1e3, "measured ms": m["time"] * 1e3,
             "predicted MiB": p.memory / 2**20, "measured MiB": m["memory"] / 2**20, "fits": p.fits}
            for p, m in zip(ranked, measured)]
    return _summary(rows)


def repredicted(name: str, result: dict, cluster: Cluster) -> dict:
    """``result``'s measurements against predictions made now on ``cluster`` (after a change to the cost model or
    its calibration; the rows keep what was measured): the same summary as ``run_model``'s."""
    now = {p.layout.label(): p for p in predictions(name, cluster)}
    rows = [r | {"predicted ms": now[r["layout"]].step_time * 1e3, "predicted MiB": now[r["layout"]].memory / 2**20,
                 "fits": now[r["layout"]].fits} for r in result["rows"] if r["layout"] in now]
    rows.sort(key=lambda r: (not r["fits"], r["predicted ms"]))
    return _summary(rows)


def _summary(rows: list[dict]) -> dict:
    best = min(rows, key=lambda r: r["measured ms"])
    return {"rows": rows, "chosen": rows[0]["layout"], "best measured": best["layout"],
            "chosen / best measured": rows[0]["measured ms"] / best["measured ms"],
            "spearman time": spearman([r["predicted ms"] for r in rows], [r["measured ms"] for r in rows]),
            "spearman memory": spearman([r["predicted MiB"] for r in rows], [r["measured MiB"] for r in rows])}


def report(name: str, result: dict) -> str:
    """The table of one model's layouts, best predicted first, and its summary line."""
    lines = [f"{name}: chosen {result['chosen']} at {result['chosen / best measured']:.3f}x the best measured "
             f"({result['best measured']}); Spearman time {result['spearman time']:.3f}, memory "
             f"{result['spearman memory']:.3f}",
             f"  {'layout':<34}{'pred ms':>9}{'meas ms':>9}{'pred MiB':>10}{'meas MiB':>10}"]
    for r in result["rows"]:
        lines.append(f"  {r['layout']:<34}{r['predicted ms']:>9.2f}{r['measured ms']:>9.2f}"
                     f"{r['predicted MiB']:>10.2f}{r['measured MiB']:>10.2f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Measure the models asked for, print their tables, and write the results."""
    p = argparse.ArgumentParser(prog="python -m bench.layouts", description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--out", type=Path, default=RESULTS, help=f"results file (default {RESULTS})")
    p.add_argument("--repredict", action="store_true",
                   help="measure nothing: compare the stored measurements with the current predictions")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    results = json.loads(args.out.read_text()) if args.out.exists() else {}
    if not args.repredict or "calibration" not in results:
        results["calibration"] = run_on_ranks(calibrate, "cpu", [1] * WORLD)[0]
    print("calibration:", {k: round(v, 3) for k, v in results["calibration"].items()}, flush=True)
    cluster = measured_cluster(results["calibration"])
    for name in args.models.split(","):
        if args.repredict and name not in results:
            continue
        results[name] = (repredicted(name, results[name], cluster) if args.repredict
                         else run_model(name, args.steps, cluster))
        print(report(name, results[name]), flush=True)
        args.out.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
