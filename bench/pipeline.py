"""Pipeline parallelism benchmarks (issue items 1's tp=2 x pp=2 part and 5): hooks, to be filled in.

autotp does not take ``pp`` yet. Until it does, both sections report themselves skipped with
``PP_MISSING``. The pieces that do not need a pipeline are here already: the ideal bubble and the
even-by-layer-count split the planner's balance is compared with.

To fill in (the API they will use):
    autotp.parallelize(model, tp=2, pp=2, example_inputs=..., microbatches=m, schedule="gpipe" | "1f1b")
    autotp.plan(model, tp, example_inputs, pp=2, balance="both").stages / .imbalance()
``tp_pp_runtime`` times tp=2 x pp=2 (4 ranks) against a hand-written pipeline split of the Megatron
reference; ``schedules`` times GPipe and 1F1B at 1, 2, 4, 8 microbatches against ``ideal_bubble`` and
compares ``plan.imbalance()`` with ``even_split_imbalance``.
"""

from __future__ import annotations

import inspect

import autotp
from bench.config import BenchConfig

PP_MISSING = "needs pipeline parallelism (autotp pp>1), not available yet"
MICROBATCHES = (1, 2, 4, 8)
SCHEDULES = ("gpipe", "1f1b")


def pp_available() -> bool:
    """Whether ``autotp.parallelize`` accepts ``pp``."""
    return "pp" in inspect.signature(autotp.parallelize).parameters


def ideal_bubble(stages: int, microbatches: int) -> float:
    """Fraction of a GPipe/1F1B step a stage idles with equal stages: (p - 1) / (m + p - 1)."""
    if stages < 1 or microbatches < 1:
        raise ValueError(f"stages and microbatches must be >= 1, got p={stages}, m={microbatches}")
    return (stages - 1) / (microbatches + stages - 1)


def even_split(n_layers: int, stages: int) -> list[int]:
    """Blocks per stage when split evenly by count (the first stages take the remainder)."""
    if stages < 1 or n_layers < stages:
        raise ValueError(f"cannot split {n_layers} layers into {stages} stages")
    base, extra = divmod(n_layers, stages)
    return [base + (i < extra) for i in range(stages)]


def even_split_imbalance(block_cost: float, extra_first: float, extra_last: float, n_layers: int,
                         stages: int) -> float:
    """max/mean stage cost of an even-by-count split, with the embedding's cost on the first stage and
    the head's on the last (why counting layers is not enough)."""
    counts = even_split(n_layers, stages)
    costs = [c * block_cost for c in counts]
    costs[0] += extra_first
    costs[-1] += extra_last
    return max(costs) / (sum(costs) / len(costs))


def _skipped(what: str) -> dict:
    if not pp_available():
        return {"skipped": PP_MISSING}
    return {"skipped": f"autotp accepts pp, but {what} in bench/pipeline.py is not written yet"}


def tp_pp_runtime(cfg: BenchConfig) -> dict:
    """Item 1 at tp=2 x pp=2: autotp's step time against a hand-written pipeline split (4 ranks)."""
    return _skipped("tp_pp_runtime")


def schedules(cfg: BenchConfig) -> dict:
    """Item 5: GPipe and 1F1B step time at 1, 2, 4, 8 microbatches against the ideal bubble; stage
    imbalance of the planner's split against an even split by layer count."""
    out = _skipped("schedules")
    out["ideal_bubble_pp2"] = {m: ideal_bubble(2, m) for m in MICROBATCHES}
    return out


def pipeline_section(cfg: BenchConfig) -> dict:
    """Both pipeline measurements (each skipped, with the reason, while autotp has no pp)."""
    return {"tp_pp_runtime": tp_pp_runtime(cfg), "schedules": schedules(cfg)}
