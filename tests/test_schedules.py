"""Zero-bubble and DualPipe schedules (torch's) train exactly like the original, on the right stages."""

from __future__ import annotations

import pytest

from autotp.options import Options, Schedule
from tests import capture_cache, models, schedule_workers
from tests.distributed import run_on_ranks

SPLIT = [["gpt", "zbv"], ["llama", "dualpipev"], ["hf_llama", "interleavedzb"], ["gpt", "zbv", "blocks"]]
LAYOUTS = [(1, 2), (2, 2)]


@pytest.fixture(scope="module")
def schedules() -> list[dict]:
    """Both layouts in one spawn of 4 ranks (start-up paid once): each rank's results. Each model is captured here
    first, not once per rank."""
    for name in sorted({case[0] for case in SPLIT}):
        capture_cache.warm(models.build(name, layers=schedule_workers.LAYERS), schedule_workers.example())
    return run_on_ranks(schedule_workers.check_layouts, 4, [list(layout) for layout in LAYOUTS], SPLIT)


@pytest.mark.parametrize("tp, pp", LAYOUTS)
def test_split_backward_schedules_train_like_the_original(schedules, tp, pp):
    results = [rank[f"tp={tp} pp={pp}"] for rank in schedules[:tp * pp]]
    assert sorted(results[0]) == sorted("/".join(case) for case in SPLIT), "not every case ran"
    v_ranks = {0: [0, 3], 1: [1, 2]}  # rank r holds stages r and 2*pp-1-r
    for rank, result in enumerate(results):
        pp_rank = rank // tp
        assert result["gpt/zbv"]["held"] == v_ranks[pp_rank], result
        assert result["hf_llama/interleavedzb"]["held"] == [pp_rank, pp_rank + 2], result


def test_v_placement():
    assert [Schedule.ZBV.rank_of(s, 2) for s in range(4)] == [0, 1, 1, 0]
    assert [Schedule.DUALPIPE_V.rank_of(s, 3) for s in range(6)] == [0, 1, 2, 2, 1, 0]
    assert [Schedule.INTERLEAVED_ZERO_BUBBLE.rank_of(s, 2) for s in range(4)] == [0, 1, 0, 1]
    assert Options(pp=2, schedule="zbv").stages == 4


def test_v_schedules_refuse_other_stage_counts():
    import autotp

    with pytest.raises(autotp.InputError, match="zbv places exactly 2 stages per rank"):
        Options(pp=2, schedule="zbv", virtual_stages=3, microbatches=6)


def test_split_backward_refuses_shared_kv_heads_at_plan_time():
    import autotp
    from tests import models

    model, example = models.build("hf_llama", layers=2), (models.tokens(2, 16, 0),)
    assert autotp.plan(model, tp=4, pp=2, schedule="1f1b", example_inputs=example).pp == 2  # 1F1B takes it
    with pytest.raises(autotp.PlanError, match="schedule zbv computes weight gradients apart.*k_proj"):
        autotp.plan(model, tp=4, pp=2, schedule="zbv", example_inputs=example)


def test_split_backward_refuses_data_parallelism():
    import autotp

    with pytest.raises(autotp.InputError, match="dualpipev .* not verified with data parallelism"):
        Options(pp=2, dp=2, schedule="dualpipev")
