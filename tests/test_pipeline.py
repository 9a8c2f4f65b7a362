"""Pipeline and 2-D (tp x pp) parallelism train exactly like the original; the balancer is optimal."""

from __future__ import annotations

import random

import pytest
import torch

import autotp
from autotp.options import Balance
from autotp.planning.balance import balanced_split, brute_force, objective
from examples.gpt import build_gpt
from tests import capture_cache, models, pipeline_workers
from tests.distributed import run_on_ranks

CONFIGS = {
    (1, 2): [["gpt", "gpipe"], ["llama", "1f1b"], ["hf_llama", "1f1b"], ["hf_gpt2", "gpipe"]],
    (2, 2): [["gpt", "1f1b"], ["llama", "gpipe"], ["hf_llama", "gpipe"], ["hf_gpt2", "1f1b"]],
    (1, 4): [["gpt", "gpipe"], ["hf_llama", "1f1b"]],
}
"""Every model with both schedules over the first two layouts, a sample at pp=4."""
INTERLEAVED = ["gpt", "interleaved1f1b"]
"""Run at tp=1, pp=2 with the CONFIGS there: 4 virtual stages on 2 ranks."""


def _run_at(tp: int, pp: int) -> list[list[str]]:
    return CONFIGS[(tp, pp)] + ([INTERLEAVED] if (tp, pp) == (1, 2) else [])


@pytest.fixture(scope="module")
def pipelines() -> dict:
    """Every layout, and the input errors, in one spawn of 4 ranks (start-up paid once); rank 0's results. Each
    model is captured here first, not once per rank."""
    for name in sorted({case[0] for cases in CONFIGS.values() for case in cases}):
        capture_cache.warm(models.build(name, layers=pipeline_workers.LAYERS), pipeline_workers.example())
    return run_on_ranks(pipeline_workers.check_layouts, 4, [[tp, pp, _run_at(tp, pp)] for tp, pp in CONFIGS])[0]


@pytest.mark.parametrize("tp, pp", list(CONFIGS))
def test_pipeline_trains_like_the_original(pipelines, tp, pp):
    results = pipelines[f"tp={tp} pp={pp}"]
    assert sorted(results) == sorted("/".join(case) for case in _run_at(tp, pp)), "not every case ran"
    for key, r in results.items():
        if key == "/".join(INTERLEAVED):
            continue  # its stages: test_interleaved_schedule_with_virtual_stages
        assert len(r["stages"]) == pp, key
        # Each rank holds about total/(tp·pp): its stage's shards (plus small replicated norms and, on the
        # head's stage, its copy of a tied embedding). All-replicated would be tp·pp times that.
        share = r["local_params"] / (r["total_params"] / (tp * pp))
        assert share <= 1.6, f"{key}: a rank holds {share:.2f} x total/(tp*pp)"


def test_interleaved_schedule_with_virtual_stages(pipelines):
    assert len(pipelines["tp=1 pp=2"]["/".join(INTERLEAVED)]["stages"]) == 4


def test_pipeline_input_errors(pipelines):
    messages = pipelines["errors"]
    assert "tp=2 x pp=2 needs 4" in messages["world"]
    assert "batch size 4 is not divisible by microbatches=3" in messages["microbatches"]
    assert "1f1b needs at least 2 microbatches" in messages["too_few"]


@pytest.mark.parametrize("balance", list(Balance))
def test_dp_split_equals_brute_force(balance):
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(1, 9)
        stages = rng.randint(1, n)
        compute = [rng.uniform(0, 10) for _ in range(n)]
        params = [rng.uniform(0, 10) for _ in range(n)]
        forced = sorted(rng.sample(range(1, n), min(stages - 1, rng.randint(0, 2)))) if n > 1 else []
        starts = balanced_split(compute, params, stages, balance, forced)
        best, _ = brute_force(compute, params, stages, balance, forced)
        assert objective(compute, params, starts, balance) == pytest.approx(best, rel=1e-12, abs=1e-12)
        assert set(forced) <= set(starts)


class _Tapered(torch.nn.Module):
    """Blocks whose width shrinks with depth: equal layer counts per stage would be badly balanced."""

    def __init__(self, widths=(256, 128, 64, 32, 16, 16)):
        super().__init__()
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(32, w), torch.nn.GELU(), torch.nn.Linear(w, 32)) for w in widths)

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        return x


def test_uneven_blocks_are_not_split_by_layer_count():
    example = (torch.randn(4, 8, 32),)
    plan = autotp.plan(_Tapered(), tp=1, pp=2, example_inputs=example)
    assert list(plan.stages[0].modules) == ["blocks.0"], plan.summary()  # the widest block weighs about as much as the rest
    even = autotp.plan(_Tapered(), tp=1, pp=2, cuts=["blocks.3"], example_inputs=example)  # 3 blocks per stage
    assert plan.imbalance()["compute"] < 1.2 < even.imbalance()["compute"], (plan.summary(), even.summary())


def test_heavy_head_moves_the_cut():
    """A large vocabulary makes the LM head expensive: the last stage must take fewer blocks."""
    example = (models.tokens(2, 16, 0),)
    torch.manual_seed(0)
    light = autotp.plan(build_gpt(n_layer=4), tp=1, pp=2, balance="compute", example_inputs=example)
    heavy = autotp.plan(build_gpt(n_layer=4, vocab_size=4096), tp=1, pp=2, balance="compute", example_inputs=example)
    assert len(heavy.stages[1].modules) < len(light.stages[1].modules), (light.summary(), heavy.summary())


def test_forced_cut_by_module_name():
    plan = autotp.plan(models.build("gpt", layers=4), tp=1, pp=2, cuts=["transformer.h.1"],
                       example_inputs=(models.tokens(2, 16, 0),))
    assert plan.stages[1].modules[0] == "transformer.h.1"


def test_forced_cut_naming_unknown_module():
    with pytest.raises(autotp.PlanError, match="no module of that name"):
        autotp.plan(models.build("gpt"), tp=1, pp=2, cuts=["transformer.h.9"], example_inputs=(models.tokens(2, 16, 0),))


def test_pp_larger_than_cut_candidates():
    with pytest.raises(autotp.PlanError, match=r"pp=40 but GPT can be cut in only \d+ places"):
        autotp.plan(models.build("gpt"), tp=1, pp=40, example_inputs=(models.tokens(2, 16, 0),))
