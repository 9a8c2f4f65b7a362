"""The planner's stage balance (issue item 5): ``plan.imbalance()`` per balance criterion, against an
even split by layer count costed by the same model.

The even split is the planner's own plan with cuts forced at every (n_layer / pp)-th block
(``cuts=["transformer.h.6"]`` at pp=2 for 12 blocks), so both sides use the same cost model: the
embedding lands on the first stage, ``ln_f`` and the head on the last. One capture serves every plan
(``autotp.plan`` is ``make_plan(capture(...))``; capturing again per plan would only cost time).
"""

from __future__ import annotations

import torch

from autotp.capture import capture
from autotp.names import block_of
from autotp.options import Balance, Options
from autotp.planning import make_plan
from bench.config import BenchConfig
from bench.pp_variants import even_cuts
from examples.gpt import build_gpt


def blocks_per_stage(modules_per_stage: list[list[str]]) -> list[float]:
    """Transformer blocks each stage holds; a block split across two stages counts half in each."""
    owners: dict[str, list[int]] = {}
    for stage, modules in enumerate(modules_per_stage):
        for module in modules:
            block = block_of(module)  # a whole block, or a part of one cut inside it
            if block and stage not in owners.setdefault(block, []):
                owners[block].append(stage)
    counts = [0.0] * len(modules_per_stage)
    for stages in owners.values():
        for stage in stages:
            counts[stage] += 1 / len(stages)
    return counts


def _describe(plan) -> dict:
    modules = [list(s.modules) for s in plan.stages]
    return {"imbalance": plan.imbalance(), "blocks": blocks_per_stage(modules),
            "flops": [s.flops for s in plan.stages], "params": [s.param_count for s in plan.stages],
            "modules": modules}


def plans_for(captured, n_layer: int, pp: int) -> dict[str, dict]:
    """The even split and the planner's split for every balance criterion, at tp=1 and ``pp`` stages."""
    even = make_plan(captured, Options(pp=pp, cuts=tuple(even_cuts(n_layer, pp))))
    out = {"even": _describe(even)}
    for balance in Balance:
        out[balance.value] = _describe(make_plan(captured, Options(pp=pp, balance=balance)))
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
            "by_pp": {str(pp): plans_for(captured, shape.n_layer, pp) for pp in cfg.imbalance_pp}}
