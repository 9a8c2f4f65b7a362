"""The planner's stage balance (issue item 5): ``plan.imbalance()`` per balance criterion, against an
even split by layer count costed by the same model.

The even split is the planner's own plan with cuts forced at every (n_layer / pp)-th block
(``cuts=["transformer.h.6"]`` at pp=2 for 12 blocks), so both sides use the same cost model: the
embedding lands on the first stage, ``ln_f`` and the head on the last. One capture serves every plan
(``autotp.plan`` is ``make_plan(capture(...))``; capturing again per plan would only cost time).
"""

from __future__ import annotations

import re

import torch

from autotp.balance import Balance
from autotp.capture import capture
from autotp.planner import make_plan
from bench.config import BenchConfig
from bench.pp_variants import even_cuts
from examples.gpt import build_gpt

_BLOCK = re.compile(r"^transformer\.h\.\d+(?=\.|$)")


def blocks_per_stage(modules_per_stage: list[list[str]]) -> list[float]:
    """Transformer blocks each stage holds; a block split across two stages counts half in each."""
    owners: dict[str, list[int]] = {}
    for stage, modules in enumerate(modules_per_stage):
        for module in modules:
            block = _BLOCK.match(module)  # a whole block, or a part of one cut inside it
            if block and stage not in owners.setdefault(block.group(0), []):
                owners[block.group(0)].append(stage)
    counts = [0.0] * len(modules_per_stage)
    for stages in owners.values():
        for stage in stages:
            counts[stage] += 1 / len(stages)
    return counts


def held_params(modules_per_stage: list[list[str]], params: list[int], tied: int) -> list[int]:
    """Parameters each stage's ranks hold: the planner counts the tied embedding/head table once, on the
    embedding's stage, but autotp's runtime keeps a copy on the head's stage too when they differ."""
    has = [{m.split(".")[-1] for m in modules} for modules in modules_per_stage]
    return [p + (tied if "lm_head" in names and "wte" not in names else 0) for p, names in zip(params, has)]


def _max_over_mean(values: list[float]) -> float:
    return max(values) / (sum(values) / len(values))


def _describe(plan, tied: int) -> dict:
    modules = [list(s.modules) for s in plan.stages]
    params = [s.param_count for s in plan.stages]
    held = held_params(modules, params, tied)
    return {"imbalance": plan.imbalance(), "held_params_imbalance": _max_over_mean(held),
            "blocks": blocks_per_stage(modules), "flops": [s.flops for s in plan.stages], "params": params,
            "held_params": held, "modules": modules}


def plans_for(captured, n_layer: int, pp: int, tied: int) -> dict[str, dict]:
    """The even split and the planner's split for every balance criterion, at tp=1 and ``pp`` stages."""
    even = make_plan(captured, 1, pp=pp, cuts=tuple(even_cuts(n_layer, pp)), stages=pp)
    out = {"even": _describe(even, tied)}
    for balance in Balance:
        out[balance.value] = _describe(make_plan(captured, 1, pp=pp, balance=balance, stages=pp), tied)
    return out


def imbalance_section(cfg: BenchConfig) -> dict:
    """Stage imbalance (max/mean of FLOPs and of parameters) of every split, at each of ``cfg.imbalance_pp``."""
    shape = cfg.imbalance
    torch.manual_seed(cfg.seed)
    model = build_gpt(**shape.gpt_kwargs())
    example = torch.randint(0, shape.vocab_size, (shape.batch, shape.seq), generator=torch.Generator().manual_seed(1))
    captured = capture(model, (example,))
    tied = model.transformer.wte.weight.numel() if model.lm_head.weight is model.transformer.wte.weight else 0
    return {"shape": shape.describe(), "tied_params": tied,
            "by_pp": {str(pp): plans_for(captured, shape.n_layer, pp, tied) for pp in cfg.imbalance_pp}}
