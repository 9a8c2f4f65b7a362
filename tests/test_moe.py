"""Mixture-of-experts layers at Megatron's minimum: the experts' partial outputs are weighted, put back in token
order and summed (with a shared expert's) before one all-reduce of the B×T×D hidden state, and the routed
experts read the hidden state through the one ``f`` the shared expert reads it through.

Exactness: the one-process checker and 2 gloo ranks training 2 AdamW steps (Mixtral's in test_structures); bytes:
counted at run time against the dense twin of each model (``tests/moe_workers.py``)."""

from __future__ import annotations

import pytest

import autotp
from autotp.passes.steps import Direction, Operator
from tests import models
from tests.distributed import run_on_ranks
from tests.moe_workers import BATCH, BUILDERS, MOE_LAYERS, SEQ, TOP_K, TRAINED_HERE, LoopedExperts, moe


def _ids():
    return models.tokens(2, 8, 0)


def _moe_collectives(plan, layer: str) -> list:
    return [c for c in plan.collectives if c.module.startswith(f"model.layers.{layer}.mlp")]


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_each_moe_layer_all_reduces_one_hidden_state_each_way(name):
    plan = autotp.plan(BUILDERS[name](), tp=2, vocab="whole", example_inputs=(_ids(),))
    for layer in ("0", "1"):
        found = _moe_collectives(plan, layer)
        forward = [c.shape for c in found if c.direction is Direction.FORWARD]
        backward = sorted(c.shape for c in found if c.direction is Direction.BACKWARD)
        assert forward == [("B", "T", "64")], found  # after the combine (and the shared expert's sum)
        assert backward == sorted([forward[0] if name == "deepseek" else ("B*T", "64"), (f"{TOP_K}*B*T", "1")]), found
        assert {c.operator for c in found} == {Operator.F, Operator.G}


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_moe_models_are_exact_in_the_checker(name):
    report = autotp.check(BUILDERS[name](), tp=2, example_inputs=(_ids(),))
    assert report.exact, report


def test_looped_experts_share_one_f_and_one_g():
    """A loop over experts (each picking its tokens, ``index_add_`` into zeros): one all-reduce of the B×T×D
    hidden state each way, where each expert had its own, and exact."""
    ids = models.tokens(2, 8, 0) % 64
    plan = autotp.plan(LoopedExperts(), tp=2, vocab="whole", example_inputs=(ids,))
    hidden = [c for c in plan.collectives if c.shape[-1] == "32"]
    assert sorted((c.direction, c.operator, c.shape) for c in hidden) == [
        (Direction.BACKWARD, Operator.F, ("B*T", "32")), (Direction.FORWARD, Operator.G, ("B*T", "32"))]
    assert autotp.check(LoopedExperts(), tp=2, example_inputs=(ids,)).exact


def test_moe_trains_exactly_and_all_reduces_what_its_dense_twin_does_on_two_ranks():
    """Forward, every all-reduce of the MoE model is one its dense twin also runs; backward, the routing weights'
    gradient (top-k numbers per token and layer) is the only addition: it is summed over the ranks because each
    rank multiplies them by its partial expert outputs."""
    results = run_on_ranks(moe, 2)
    for rank in results:
        assert sorted(name for name, r in rank.items() if "trained" in r) == sorted(TRAINED_HERE)
        for name, r in rank.items():
            if name in TRAINED_HERE:  # Mixtral's training: test_structures
                trained = r["trained"]
                assert trained["output"] < 1e-5 and max(trained["losses"]) < 1e-5, (name, trained)
                assert max(trained["params"].values()) < 1e-5, (name, trained["params"])
            assert r["moe"]["forward"] == r["dense"]["forward"], (name, r)
            routing = MOE_LAYERS * BATCH * SEQ * TOP_K * 4
            assert r["moe"]["backward"] == {"count": r["dense"]["backward"]["count"] + MOE_LAYERS,
                                            "bytes": r["dense"]["backward"]["bytes"] + routing}, (name, r)
