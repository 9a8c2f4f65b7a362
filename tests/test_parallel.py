"""End-to-end: every model, sharded over real gloo ranks, computes and trains exactly like the original."""

from __future__ import annotations

import pytest

from tests import capture_cache, models, workers
from tests.distributed import run_each_on_ranks, run_on_ranks

ALL = list(models.BUILDERS)


@pytest.fixture(scope="module")
def warmed():
    """Every model captured here once, before any rank is forked: the ranks find the captures made (4 ranks on 2
    cores would otherwise capture each model twice per core), and the tp=1 checks hit them too."""
    for name in ALL:
        capture_cache.warm(models.build(name), (models.tokens(2, 16, seed=1),))


@pytest.fixture(scope="module")
def tp2(warmed):
    return run_on_ranks(workers.check_models, 2, ALL)


TP4_SAMPLE = ["llama", "hf_llama", "hf_gpt2", "hf_bert"]
"""The models checked at tp=4 in the default run: K/V heads shared above their count (a model of ours and
transformers'), GPT-2's Conv1D projections, BERT's lone pooler row. The others at tp=4 run with ``-m slow`` (at
tp=1 and tp=2 every model runs by default)."""


@pytest.fixture(scope="module")
def tp4(warmed):
    return run_on_ranks(workers.check_models, 4, TP4_SAMPLE)


@pytest.fixture(scope="module")
def tp4_rest(warmed):
    return run_on_ranks(workers.check_models, 4, [name for name in ALL if name not in TP4_SAMPLE])


@pytest.fixture(scope="module")
def refusals():
    """Both refusals on one group of 2 ranks (start-up paid once)."""
    return run_each_on_ranks(2, {"wrong world": (workers.wrong_world,), "mismatched": (workers.mismatched_plans,)})


BATCH_CHECK = "_allgather_base"
"""How the one-batch check's all-gather is counted (``all_gather_single``, begun before the forward)."""


def _expected_counts(result: dict) -> tuple[dict, dict]:
    """Megatron's minimum: per block one all-reduce after attention and one after the MLP (forward,
    Megatron's g) and one before each (backward, f); plus the vocabulary-split embedding's all-reduce
    and the LM head's f and output all-gather. A projection split alone (BERT's pooler: no column split closes
    around it) adds its output's all-reduce forward and its input gradient's all-gather backward. Each call
    also checks that the tp ranks hold one batch: one all-gather of a few integers (where Megatron's data path
    broadcasts the batch), begun before the forward (gloo's ``_allgather_base``), counted here with the forward's."""
    blocks, lone = result["blocks"], result["lone_rows"]
    forward = {"allreduce": 2 * blocks + result["vocab_split"] + lone, BATCH_CHECK: 1}
    if result["head_split"]:
        forward["allgather"] = 1
    backward = {"allreduce": 2 * blocks + result["head_split"]}
    if lone:
        backward["allgather"] = lone
    return forward, backward


@pytest.mark.parametrize("name", ALL)
def test_tp1_single_process(name, warmed):
    """tp=1 needs no process group and changes nothing."""
    results = workers.check_model(name, 1)
    assert results["local_params"] == results["total_params"]


def test_tp2_all_models_exact(tp2):
    for name in ALL:
        r = tp2[0][name]
        # Split parameters hold exactly 1/tp each; the rest (norms, positions) is replicated.
        assert r["local_params"] == r["total_params"] - r["split_params"] // 2, name
        # The tiny test models carry large replicated tables (BERT: 512 positions); blocks must be split.
        assert r["split_params"] > 0.6 * r["total_params"], f"{name} came out mostly replicated: {r}"
        print(f"{name}: tp=2 local params {r['local_params']} of {r['total_params']} "
              f"({r['local_params'] / (r['total_params'] / 2):.2f} x total/tp)")


def _tp4_exact(results: list) -> None:
    for name, r in results[0].items():
        # Exact accounting: a split parameter holds 1/4 on each rank, K/V heads shared by 2 ranks (tp above the
        # KV heads) 1/2.
        plain = r["split_params"] - r["shared_params"]
        assert r["local_params"] == r["total_params"] - 3 * plain // 4 - r["shared_params"] + r["shared_local"], name
        assert r["local_params"] < 0.6 * r["total_params"], f"{name} came out mostly replicated: {r}"


def test_tp4_sampled_models_exact(tp4):
    assert set(tp4[0]) == set(TP4_SAMPLE)
    _tp4_exact(tp4)


@pytest.mark.slow
def test_tp4_the_other_models_exact(tp4_rest):
    _tp4_exact(tp4_rest)
    _megatron_counts(tp4_rest, 4)
    _kv_heads_shared(tp4_rest, ("hf_mistral", "hf_qwen2"))


@pytest.mark.parametrize("tp", [2, 4])
def test_collectives_per_block_equal_megatron(tp, tp2, tp4):
    _megatron_counts({2: tp2, 4: tp4}[tp], tp)


def _megatron_counts(results: list, tp: int) -> None:
    for name, r in results[0].items():
        forward, backward = _expected_counts(r)
        assert r["forward"] == forward, f"{name} tp={tp} forward collectives {r['forward']} != {forward}"
        # With tp above the KV heads, each rank keeps the KV head its query heads use; the gradient shares of
        # each K/V weight (and bias) are summed over its holders (one all-gather each, no extra all-reduce).
        extra = {"allgather": r["shared_count"]} if r["shared_count"] else {}
        assert r["backward"] == backward | extra, f"{name} tp={tp} backward {r['backward']} != {backward | extra}"


def test_plan_lists_what_runs(tp2):
    """The plan's collectives are the ones counted at run time."""
    for name in ALL:
        r = tp2[0][name]
        for direction in ("forward", "backward"):
            # The plan lists the model's collectives; each call adds the one-batch check's all-gather.
            planned: dict[str, int] = {BATCH_CHECK: 1} if direction == "forward" else {}
            for op, d in r["planned"]:
                if d == direction:
                    key = op.replace("_", "")
                    planned[key] = planned.get(key, 0) + 1
            assert planned == r[direction], f"{name} {direction}: plan {planned} vs run {r[direction]}"


def test_gqa_above_the_kv_heads_shares_them_at_tp4(tp4):
    """4 query heads, 2 KV heads, tp=4: each rank keeps one KV head (2 ranks per head), not the whole K/V."""
    _kv_heads_shared(tp4, ("llama", "hf_llama"))


def _kv_heads_shared(results: list, names: tuple[str, ...]) -> None:
    for name in names:
        r = results[0][name]
        assert any("exceeds their heads" in n and "2 ranks per head" in n for n in r["notes"]), name
        assert r["shared_count"] >= 4 and r["shared_local"] * 2 == r["shared_params"], name


def test_world_size_must_equal_tp(refusals):
    messages = [rank["wrong world"] for rank in refusals]
    assert all("2 ranks but tp=4" in m and "torchrun --nproc-per-node 4" in m for m in messages), messages


def test_ranks_with_different_plans_fail(refusals):
    messages = [rank["mismatched"] for rank in refusals]
    assert all("ranks computed different plans" in m for m in messages), messages
