"""The body every rank runs: the multi-process sections, in one spawn so start-up is paid once."""

from __future__ import annotations

import gc

from bench.config import BenchConfig
from bench.memory import memory_section
from bench.pipeline import pipeline_ranks
from bench.runtime import runtime_section
from bench.variants import roles, tp_group


def needs_ranks(cfg: BenchConfig) -> bool:
    """Whether any chosen section runs on several processes."""
    return bool({"runtime", "comm", "memory", "pipeline"} & set(cfg.sections))


def rank_main(rank: int, world: int, cfg: BenchConfig) -> dict:
    """Runtime (with its collective counts), memory and the timed pipelines, as chosen in ``cfg.sections``.

    Memory is measured on the tensor-parallel ranks only; the baseline ranks just take part in the
    collective group creation and the runtime's barriers.
    """
    r = roles(cfg)
    if world != r.world:
        raise ValueError(f"spawned {world} ranks but the roles need {r.world}")
    tpg = tp_group(cfg)
    out = {}
    if {"runtime", "comm"} & set(cfg.sections):
        out["runtime"] = runtime_section(rank, r, tpg, cfg, time_steps="runtime" in cfg.sections)
        gc.collect()
    if {"memory", "comm"} & set(cfg.sections) and rank in tpg.ranks:
        out["memory"] = memory_section(rank, tpg, cfg)
        gc.collect()
    if "pipeline" in cfg.sections:  # last: it re-forms the process group
        out["pipeline"] = pipeline_ranks(rank, world, cfg)
    return out
