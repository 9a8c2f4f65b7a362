"""Every layout of 4 processes, measured next to the planner's prediction.

    python -m bench.layouts [--steps 7] [--twins 12] [--sample N] [--models deep-narrow,...] [--repredict]

For each model (a deep-narrow GPT, a wide-shallow GPT, a small Mixtral mixture of experts), the layout search
(``autotp.planning.layout_search``) prices every valid layout of 4 devices on this CPU machine (tp, pp, dp, dp
mode, schedule, microbatches, sequence parallelism, recompute); then 4 gloo ranks (one thread each) run every one
of them without recompute and the recompute twins of the best predicted (``measured_layouts``),
``pm.step`` on each replica's slice of the global batch followed by AdamW, and record the median step time
(``pm.step`` only, a barrier before each; the slowest rank's; layouts timed in turns, ``GROUP``) and the peak
memory of the fullest rank: its parameters and AdamW moments, plus the rise of its resident set (VmHWM, reset
before a step after the warm-up ones) over what it held before it.
Reported: Spearman's rank correlation of predicted and measured step time (and memory), the chosen layout's
measured time against the best measured, and the layouts measured over a memory budget yet predicted to fit.
Writes ``bench/results/layouts.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

import autotp
from autotp.capture import capture, example_inputs_of
from autotp.options import Options, Recompute
from autotp.planning.ep_runtime import ep_unrunnable
from autotp.planning.layout_search import search_layouts
from autotp.planning.machines import MACHINES, Link, Machine
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


def predictions(name: str, cluster: Machine = MACHINES["cpu"]) -> list:
    """Every layout of WORLD devices for model ``name`` the runtime runs (an ep it cannot run yet is priced, not
    measured: ``planning.ep_runtime``), priced on ``cluster``, best first."""
    model = _model(name)
    captured = capture(model, example_inputs_of(model, (_batch(1),)))
    ranked = search_layouts(captured, WORLD, Options(), {}, cluster).ranked
    return [p for p in ranked if ep_unrunnable(Options().replace(**p.layout.settings())) is None]


def _median_ms(fn, repeats: int = 20) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times[3:]) * 1e3


def _alone(rank: int, fn) -> float | None:
    """``_median_ms(fn)`` on rank 0 while the others wait in a barrier (their cores are free: one core's rate)."""
    dist.barrier()
    ms = _median_ms(fn) if rank == 0 else None
    dist.barrier()
    return ms


def _cores_free(rank: int, world: int, step, rounds: int = 7, calls: int = 8) -> float | None:
    """How many cores' worth ``world`` ranks get when all run ``step`` at once: ``world`` times one rank's time
    alone over the time of all of them together (the slowest's), the median over ``rounds`` that alternate the two
    (a change of the host's load falls on both alike); rank 0's answer (None on the others).
    Measured on a training step's work (eager ops over small tensors, as the layouts run), not on a matmul that
    stays in one core's cache: ranks sharing cores share caches and memory bandwidth too, so their speedup is
    below the core count; and other work on the host takes its share."""
    ratios = []
    for _ in range(rounds):
        alone = _alone(rank, step)
        dist.barrier()
        start = time.perf_counter()
        for _ in range(calls):
            step()
        dist.barrier()
        together = (time.perf_counter() - start) / calls * 1e3
        ratios.append(None if alone is None else world * alone / together)
    return None if rank else statistics.median(ratios)


def calibrate(rank: int, world: int) -> dict:
    """One core's rates, measured by one rank alone: a matmul's and an eager op's (a narrow GPT's forward and
    backward over 3x its graph's ops); the cores' worth all WORLD ranks get computing at once (``_cores_free``);
    then, on WORLD ranks at once (pairs), a gloo all-reduce's time at 4 KiB and 16 MiB, and what an all-reduce
    adds between two 1-2 ms computations when the ranks time-share the cores (the wake-ups a step's collectives
    pay, not a tight loop's)."""
    x, w = torch.randn(256, 256), torch.randn(256, 1024)
    matmul_ms = _alone(rank, lambda: x @ w)
    torch.manual_seed(0)
    gpt, ids = build_gpt(n_layer=8, n_head=4, n_embd=64, vocab_size=VOCAB, block_size=SEQ), _batch(1)[:1, :8]
    ops = sum(n.op == "call_function" for n in capture(gpt, example_inputs_of(gpt, (ids,))).module.graph.nodes)
    op_ms = _alone(rank, lambda: gpt(ids).sum().backward())
    cores_free = _cores_free(rank, world, lambda: gpt(ids).sum().backward())
    pair = [dist.new_group([2 * i, 2 * i + 1]) for i in range(world // 2)][rank // 2]
    # Large: about the size of the models' gradients (2-15 MiB), which data parallelism all-reduces.
    small, large = torch.zeros(1024), torch.zeros(1 << 22)
    dist.barrier()
    small_ms = _median_ms(lambda: dist.all_reduce(small, group=pair))
    large_ms = _median_ms(lambda: dist.all_reduce(large, group=pair), repeats=8)
    a, b = torch.randn(64, 512), torch.randn(512, 512)

    def work(sync: bool) -> float:
        dist.barrier()
        start = time.perf_counter()
        for _ in range(16):
            a @ b
            if sync:
                dist.all_reduce(small, group=pair)
        return time.perf_counter() - start
    # Alternated, so that a change of the machine's load falls on both alike; the median difference per call.
    synced_ms = statistics.median(work(True) - work(False) for _ in range(15)) / 16 * 1e3
    out = {"all_reduce 4 KiB ms": small_ms, "all_reduce 16 MiB ms": large_ms,
           "synced all_reduce ms": max(synced_ms, 0.0)}
    if rank == 0:
        out |= {"matmul GFLOP/s": 2 * 256 * 256 * 1024 / matmul_ms / 1e6, "op us": op_ms * 1e3 / (3 * ops),
                "cores": os.cpu_count() or 1, "cores free": cores_free}
    return out


def measured_cluster(cal: dict) -> Machine:
    """This machine as the bench runs it, from ``calibrate``: one core's compute and op cost, the host's cores
    (WORLD ranks time-share them), a collective's latency as the ranks pay it between computations, and the
    bandwidth of a two-rank all-reduce (2(n-1)/n = 1 at n=2)."""
    large, size = next((cal[k], n << 20) for k, n in (("all_reduce 16 MiB ms", 16), ("all_reduce 1 MiB ms", 1))
                       if k in cal)
    bandwidth = size / max(large - cal["all_reduce 4 KiB ms"], 1e-3) * 1e3
    latency = max(cal.get("synced all_reduce ms", 0.0), cal["all_reduce 4 KiB ms"]) / 1e3
    machine = Link("CPU over gloo, as measured", cal["matmul GFLOP/s"] * 1e9, bandwidth, latency,
                      cal["op us"] / 1e6)
    # The ranks' share of the host: with other work running, 4 ranks get more of it than one (the scheduler
    # shares the cores per task), so the cores they effectively time-share are measured, at most the host's.
    cores = min(cal.get("cores free", cal.get("cores", os.cpu_count() or 1)), cal.get("cores", os.cpu_count() or 1))
    return Machine("cpu-measured", f"{WORLD} gloo ranks on {cores:.3g} cores, calibrated under the bench's load",
                   machine, machine, 1 << 30, None, cores)


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


WARMUP = 3
"""Untimed steps first: the first builds AdamW's moments and gloo's buffers, the next warm the caches."""

GROUP = 8
"""Layouts alive at once, timed in turns: a step of each in every round, so that a burst of other work on the
shared machine falls on every layout of the group alike rather than on one layout's steps (measured: run one
after another, identical schedules differed 2-3x). Eight keep the ranks' memory small."""


class _Run:
    """One layout's module, optimizer and batch slice on this rank."""

    def __init__(self, pm):
        x, y = _batch(2), _batch(3)
        rows = slice(pm.dp_rank * BATCH // pm.dp_size, (pm.dp_rank + 1) * BATCH // pm.dp_size)
        self.pm, self.x, self.y = pm, x[rows], y[rows]
        self.opt = torch.optim.AdamW(pm.parameters(), lr=1e-4)

    def step(self) -> float:
        """One training step after a barrier (every rank starts it together): ``pm.step``'s seconds."""
        dist.barrier()
        start = time.perf_counter()
        self.pm.step(self.x, target=self.y)
        took = time.perf_counter() - start
        self.opt.step()
        self.opt.zero_grad()
        return took

    def memory(self) -> int:
        """WARMUP steps, then one more: its peak memory (the state, and the resident set's rise over what the
        rank held before it: the moments exist by then)."""
        for _ in range(WARMUP):
            self.step()
        Path("/proc/self/clear_refs").write_text("5")
        before = _status("VmRSS")
        self.step()
        return _state_bytes(self.pm) + max(0, _status("VmHWM") - before)


def measure_all(rank: int, world: int, name: str, layouts: list[dict], steps: int) -> list:
    """On each rank: parallelize model ``name`` at every layout, GROUP at a time, and measure them (``_Run``),
    ``steps`` rounds of one step each; per layout (on rank 0) the median over the rounds of the slowest rank's
    step and the fullest rank's memory."""
    out = []
    for first in range(0, len(layouts), GROUP):
        runs = [_Run(autotp.parallelize(_model(name), example_inputs=(_batch(1),), **settings))
                for settings in layouts[first:first + GROUP]]
        memory = [run.memory() for run in runs]
        times = [[run.step() for run in runs] for _ in range(steps)]
        everyone = [None] * world
        dist.all_gather_object(everyone, (memory, times))
        for i, settings in enumerate(layouts[first:first + GROUP]):
            slowest = [max(t[r][i] for _, t in everyone) for r in range(steps)]
            out.append({"time": statistics.median(slowest), "memory": max(m[i] for m, _ in everyone)})
            if rank == 0:
                print(f"  {name} {len(out)}/{len(layouts)} {settings}: {out[-1]['time'] * 1e3:.1f} ms", flush=True)
        del runs
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


def measured_layouts(ranked: list, twins: int, sample: int | None = None) -> list:
    """The layouts the bench measures from the search's ``ranked`` ones: every one without recompute (or
    ``sample`` of them: the 4 best predicted and the rest evenly spaced over the ranking, for a loaded machine),
    and the recompute twins of the ``twins`` best predicted of those (every layout has one; measuring them all
    would double the bench's hour)."""
    plain = [p for p in ranked if p.layout.recompute is Recompute.NONE]
    if sample is not None and sample < len(plain):
        rest = plain[4:]
        step = len(rest) / max(sample - 4, 1)
        plain = plain[:4] + [rest[int(i * step)] for i in range(sample - 4)]
    wanted = {dataclasses.replace(p.layout, recompute=Recompute.BLOCKS) for p in plain[:twins]}
    wanted |= {p.layout for p in plain}
    return [p for p in ranked if p.layout in wanted]


def run_model(name: str, steps: int, cluster: Machine, twins: int = 12, sample: int | None = None) -> dict:
    """Predict (on ``cluster``), measure and compare the layouts of model ``name`` (``measured_layouts``)."""
    ranked = measured_layouts(predictions(name, cluster), twins, sample)
    measured = run_on_ranks(measure_all, "cpu", [1] * WORLD, name, [_settings(p) for p in ranked], steps)[0]
    rows = [{"layout": p.layout.label(), "predicted ms": p.step_time * 1e3, "measured ms": m["time"] * 1e3,
             "predicted MiB": p.memory / 2**20, "measured MiB": m["memory"] / 2**20, "fits": p.fits}
            for p, m in zip(ranked, measured)]
    return _summary(rows)


def repredicted(name: str, result: dict, cluster: Machine) -> dict:
    """``result``'s measurements against predictions made now on ``cluster`` (after a change to the cost model or
    its calibration; the rows keep what was measured): the same summary as ``run_model``'s."""
    now = {p.layout.label(): p for p in predictions(name, cluster)}
    rows = [r | {"predicted ms": now[r["layout"]].step_time * 1e3, "predicted MiB": now[r["layout"]].memory / 2**20,
                 "fits": now[r["layout"]].fits} for r in result["rows"] if r["layout"] in now]
    rows.sort(key=lambda r: (not r["fits"], r["predicted ms"]))
    return _summary(rows)


def _summary(rows: list[dict]) -> dict:
    best = min(rows, key=lambda r: r["measured ms"])
    # A budget that half the layouts exceed: the search must predict every one of those as not fitting.
    budget = statistics.median(r["measured MiB"] for r in rows)
    return {"rows": rows, "chosen": rows[0]["layout"], "best measured": best["layout"],
            "chosen / best measured": rows[0]["measured ms"] / best["measured ms"],
            "spearman time": spearman([r["predicted ms"] for r in rows], [r["measured ms"] for r in rows]),
            "spearman memory": spearman([r["predicted MiB"] for r in rows], [r["measured MiB"] for r in rows]),
            "budget MiB": budget,
            "over budget predicted to fit": [r["layout"] for r in rows
                                             if r["measured MiB"] > budget >= r["predicted MiB"]]}


def report(name: str, result: dict) -> str:
    """The table of one model's layouts, best predicted first, and its summary line."""
    lines = [f"{name}: chosen {result['chosen']} at {result['chosen / best measured']:.3f}x the best measured "
             f"({result['best measured']}); Spearman time {result['spearman time']:.3f}, memory "
             f"{result['spearman memory']:.3f}; over a budget of {result['budget MiB']:.3g} MiB yet predicted to fit: "
             f"{', '.join(result['over budget predicted to fit']) or 'none'}",
             f"  {'layout':<34}{'pred ms':>9}{'meas ms':>9}{'pred MiB':>10}{'meas MiB':>10}"]
    for r in result["rows"]:
        lines.append(f"  {r['layout']:<34}{r['predicted ms']:>9.2f}{r['measured ms']:>9.2f}"
                     f"{r['predicted MiB']:>10.2f}{r['measured MiB']:>10.2f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Measure the models asked for, print their tables, and write the results."""
    p = argparse.ArgumentParser(prog="python -m bench.layouts", description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=7, help="timed rounds (a step of each layout of a group)")
    p.add_argument("--twins", type=int, default=12, help="recompute twins measured: of the N best predicted layouts")
    p.add_argument("--sample", type=int, help="measure N layouts without recompute, not all (measured_layouts)")
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--out", type=Path, default=RESULTS, help=f"results file (default {RESULTS})")
    p.add_argument("--repredict", action="store_true",
                   help="measure nothing: compare the stored measurements with the current predictions")
    p.add_argument("--calibration-from", type=Path,
                   help="with --repredict: price with the calibration stored in this results file instead")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    results = json.loads(args.out.read_text()) if args.out.exists() else {}
    if args.repredict and args.calibration_from is not None:
        results["calibration"] = json.loads(args.calibration_from.read_text())["calibration"]
    elif not args.repredict or "calibration" not in results:
        results["calibration"] = run_on_ranks(calibrate, "cpu", [1] * WORLD)[0]
    print("calibration:", {k: round(v, 3) for k, v in results["calibration"].items()}, flush=True)
    cluster = measured_cluster(results["calibration"])
    for name in args.models.split(","):
        if args.repredict and name not in results:
            continue
        results[name] = (repredicted(name, results[name], cluster) if args.repredict
                         else run_model(name, args.steps, cluster, args.twins, args.sample))
        print(report(name, results[name]), flush=True)
        args.out.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
