"""Mixture-of-experts layers at Megatron's minimum: the experts' partial outputs are weighted, put back in token
order and summed (with a shared expert's) before one all-reduce of the B×T×D hidden state, and the routed
experts read the hidden state through the one ``f`` the shared expert reads it through.

Exactness: the one-process checker and 2 gloo ranks training 2 AdamW steps (Mixtral's in test_structures); bytes:
counted at run time against the dense twin of each model (``tests/moe_workers.py``)."""

from __future__ import annotations

from functools import partial

import pytest
import torch

import autotp
from autotp.capture import capture
from autotp.errors import CaptureError, UnseenExpertError
from autotp.passes.placement import Placement, PlacementKind
from autotp.passes.steps import Direction, Operator
from tests import models
from tests.distributed import run_on_ranks
from tests.moe_workers import (
    BANK_LOOPS,
    BATCH,
    MOE_LAYERS,
    PLANNED,
    SEQ,
    TOP_K,
    TRAINED_HERE,
    GatedBankExperts,
    HitExperts,
    LoopedExperts,
    NamedExperts,
    bank_loops,
    moe,
)


def _ids():
    return models.tokens(2, 8, 0)


def _moe_collectives(plan, layer: str) -> list:
    return [c for c in plan.collectives if c.module.startswith(f"model.layers.{layer}.mlp")]


@pytest.mark.parametrize("name", sorted(PLANNED))
def test_each_moe_layer_all_reduces_one_hidden_state_each_way(name):
    """GPT-OSS's included: its experts' biases are added to their partial outputs by one rank (``Operator.ONCE``),
    so its all-reduce too comes after the combine."""
    plan = autotp.plan(PLANNED[name](), tp=2, vocab="whole", example_inputs=(_ids(),))
    for layer in ("0", "1"):
        found = _moe_collectives(plan, layer)
        forward = [c.shape for c in found if c.direction is Direction.FORWARD]
        backward = sorted(c.shape for c in found if c.direction is Direction.BACKWARD)
        assert forward == [("B", "T", "64")], found  # after the combine (and the shared expert's sum)
        assert backward == sorted([forward[0] if name == "deepseek" else ("B*T", "64"), (f"{TOP_K}*B*T", "1")]), found
        assert {c.operator for c in found} == {Operator.F, Operator.G}


@pytest.mark.parametrize("name", sorted(PLANNED))
def test_moe_models_are_exact_in_the_checker(name):
    report = autotp.check(PLANNED[name](), tp=2, example_inputs=(_ids(),))
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


def _hit_model(skips: bool = True, spare: int = 1) -> HitExperts:
    torch.manual_seed(0)
    return HitExperts(skips=skips, spare=spare)


def _never_3(model) -> torch.Tensor:
    """A batch routing no token to expert 3."""
    routes = model.routes(torch.arange(64))
    return torch.arange(64)[(routes != 3).all(-1)][:16].view(2, 8)


def _computes_every_expert(model, captured) -> None:
    with torch.no_grad():
        for batch in (models.tokens(2, 8, 0) % 64, _never_3(model)):
            got = captured.module(batch)
            assert torch.allclose(got[0] if isinstance(got, tuple) else got, model.eval()(batch), atol=1e-6)


def test_a_loop_over_the_experts_hit_is_captured_over_every_expert():
    """``for e in hit.nonzero()``: captured over every expert (a loop as long as a tensor's value cannot be traced;
    an expert without tokens adds nothing), exact in the checker; captured from an example that routes no token
    to expert 3, it still computes the model on a batch that does."""
    assert autotp.check(_hit_model(), tp=2, example_inputs=(models.tokens(2, 8, 0) % 64,)).exact
    model = _hit_model()
    narrow = capture(model, (_never_3(model),), training=False)
    assert narrow.assumptions and "runs over every expert (every index" in narrow.assumptions[0]
    _computes_every_expert(model, narrow)


def test_a_loop_whose_body_cannot_run_the_class_for_no_expert_is_captured_over_every_other():
    """Without the check that skips the mask's last class (no expert), its ``W[e]`` is past the banks' end (DBRX's
    loop): captured over every index but that one, so every expert is still computed."""
    model = _hit_model(skips=False)
    narrow = capture(model, (_never_3(model),), training=False)
    assert "every index of its routing vector but the last" in narrow.assumptions[0]
    _computes_every_expert(model, narrow)


def test_a_loop_that_cannot_run_an_expert_never_hit_is_captured_over_those_hit_and_refuses_others():
    """Two classes past the banks' end: the loop is captured over the experts the example routes to, and a batch
    routing to another raises an autotp error rather than computing without it."""
    model = _hit_model(skips=False, spare=2)
    narrow = capture(model, (_never_3(model),), training=False)
    assert "experts the example routes to" in narrow.assumptions[0]
    with pytest.raises(UnseenExpertError, match="routes tokens to an expert that the loop over the experts hit at"):
        narrow.module(models.tokens(2, 8, 0) % 64)


def test_experts_picked_by_name_in_the_loop_and_a_router_cast_to_its_own_dtype_are_captured_and_exact():
    """``self.experts[f"expert_{e[0]}"]`` reads the loop's expert as a number, and ``router.to(its dtype)`` each
    call: both failed the capture (a fake tensor formats as its description; ``Module._apply`` cannot swap a fake
    parameter), although neither changes what the model computes."""
    torch.manual_seed(0)
    model = NamedExperts()
    captured = capture(model, (models.tokens(2, 8, 0) % 64,), training=False)
    assert captured.assumptions and "runs over every expert" in captured.assumptions[0]
    torch.manual_seed(0)
    assert autotp.check(NamedExperts(), tp=2, example_inputs=(models.tokens(2, 8, 0) % 64,)).exact


def test_a_loop_over_the_experts_hit_that_does_more_than_write_their_tokens_is_refused():
    torch.manual_seed(0)
    with pytest.raises(CaptureError, match="not a write of its tokens' rows"):
        capture(HitExperts(extra=True), (models.tokens(2, 8, 0) % 64,), training=False)


COLUMN, ROW = PlacementKind.COLWISE, PlacementKind.ROWWISE
BANK_SPLITS = {
    # gate and up side by side in one [E, D, 2F] bank, cut apart after the matmul: each rank its share of both
    "privacy filter (gated bank)": {"gate_up": Placement(COLUMN, 2, (32, 32)), "gate_up_bias": Placement(COLUMN, 1, (32, 32)),
                                    "down": Placement(ROW, 1)},
    # [E*F, D] viewed as [E, F, D]: the same rows of every expert's block
    # gate and up alternating: a plain split keeps each rank's gate and up columns in pairs
    "gpt-oss style (interleaved gate/up bank)": {"gate_up": Placement(COLUMN, 2), "gate_up_bias": Placement(COLUMN, 1),
                                                 "down": Placement(ROW, 1)},
    "dbrx (folded bank)": {"w1": Placement(COLUMN, 0, (32,) * 4), "v1": Placement(COLUMN, 0, (32,) * 4),
                           "w2": Placement(ROW, 0, (32,) * 4)},
}


CHECKED_LOOPS = BANK_LOOPS | {"gpt-oss style (interleaved gate/up bank)": partial(GatedBankExperts, interleaved=True)}
"""The loops over banks checked in one process (BANK_LOOPS also train on gloo)."""


@pytest.mark.parametrize("name", sorted(CHECKED_LOOPS))
def test_a_loop_over_banks_indexed_per_expert_splits_each_expert_alike_exactly(name):
    """Banks read one expert's matrix at a time in a loop over the experts hit (``x.float() @ W[e].float()``,
    ``W.view(E, F, D)[e].T``) split as column and row projections inside every expert, exact at tp=2 and 4; the
    experts' picks of the hidden state share one ``f``, as do their picks of the routing weights (each iteration's
    ``weights.unsqueeze(-1)[token, slot]``), and their partial outputs one ``g`` after they are combined (the privacy
    filter's per-expert bias, added to a partial output, is added by one rank: ``Operator.ONCE``)."""
    ids = models.tokens(2, 8, 0) % 64
    torch.manual_seed(0)
    plan = autotp.plan(CHECKED_LOOPS[name](), tp=2, vocab="whole", example_inputs=(ids,))
    assert {k: plan.placements[k] for k in BANK_SPLITS[name]} == BANK_SPLITS[name]
    found = sorted((c.direction, c.operator, c.shape) for c in plan.collectives)
    assert found == [(Direction.BACKWARD, Operator.F, ("B*T", "2")), (Direction.BACKWARD, Operator.F, ("B*T", "32")),
                     (Direction.FORWARD, Operator.G, ("B*T", "32"))], plan.collectives
    for tp in (2, 4):
        torch.manual_seed(0)
        assert autotp.check(CHECKED_LOOPS[name](), tp=tp, example_inputs=(ids,)).exact


def _trained_exactly(name: str, trained: dict) -> None:
    assert trained["output"] < 1e-5 and max(trained["losses"]) < 1e-5, (name, trained)
    assert max(trained["params"].values()) < 1e-5, (name, trained["params"])
    assert set(trained["must_split"]) <= set(trained["split"]), (name, trained)


def test_moe_trains_exactly_and_all_reduces_what_its_dense_twin_does_on_two_ranks():
    """Forward, every all-reduce of the MoE model is one its dense twin also runs; backward, the routing weights'
    gradient (top-k numbers per token and layer) is the only addition: it is summed over the ranks because each
    rank multiplies them by its partial expert outputs."""
    results = run_on_ranks(moe, 2)
    for rank in results:
        assert sorted(name for name, r in rank.items() if "trained" in r) == sorted(TRAINED_HERE)
        for name, r in rank.items():
            if "trained" in r:  # Mixtral's training: test_structures
                _trained_exactly(name, r["trained"])
            assert r["moe"]["forward"] == r["dense"]["forward"], (name, r)
            routing = MOE_LAYERS * BATCH * SEQ * TOP_K * 4
            assert r["moe"]["backward"] == {"count": r["dense"]["backward"]["count"] + MOE_LAYERS,
                                            "bytes": r["dense"]["backward"]["bytes"] + routing}, (name, r)


def test_loops_over_banks_indexed_per_expert_train_exactly_on_two_ranks():
    """The privacy filter's gated bank and DBRX's folded one, their banks split."""
    for rank in run_on_ranks(bank_loops, 2):
        assert sorted(rank) == sorted(BANK_LOOPS)
        for name, r in rank.items():
            _trained_exactly(name, r["trained"])


QWEN4_INDEXED = dict(layer_types=["linear_attention", "indexed_attention"], indexer_n_heads=2, indexer_kv_heads=1,
                     indexer_head_dim=16, indexer_budget=8, indexer_compress_ratio=4)
"""A tiny Qwen4-exp (hidden 64, 4 experts, top-2, 2 KV heads) with an indexed-attention layer, which the zoo's
tiny config (linear attention only) lacks: its indexer views a projection by sizes read off a repeated
embedding, and the planner once took those sizes for tensors the gradient flows through and asked their shape."""


QWEN4_INDEXED_ONLY = QWEN4_INDEXED | dict(layer_types=["indexed_attention"], num_hidden_layers=1)
"""The indexed-attention layer alone: the part of the model the planner once failed on, at a third of the time
(the linear-attention layer's chunked scan is most of the capture); the two-layer model runs with ``-m slow``."""


@pytest.mark.parametrize("config", [QWEN4_INDEXED_ONLY, pytest.param(QWEN4_INDEXED, marks=pytest.mark.slow)],
                         ids=["indexed", "linear-and-indexed"])
def test_qwen4_exp_with_an_indexed_attention_layer_plans_and_is_exact(config):
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "Qwen4ExpForCausalLM"):
        pytest.skip("this transformers has no Qwen4-exp")
    from devtools.tiny import quiet, tiny_model

    torch.manual_seed(0)
    with quiet():
        model = tiny_model("qwen4_exp_text", transformers.Qwen4ExpForCausalLM, config)
    assert (model.config.hidden_size, model.config.num_experts, model.config.num_experts_per_tok) == (64, 4, 2)
    assert model.config.layer_types == config["layer_types"]
    report = autotp.check(model, tp=2, example_inputs=(torch.randint(0, 128, (2, 8)),))
    assert report.exact, report


def test_each_expert_of_a_loop_over_gated_banks_has_one_chain_from_its_rows_to_its_bias():
    """``passes.loop_banks``: in the OpenAI privacy filter's loop (fp32 casts and their dtype checks, gate and up
    in one bank, a bias after each matmul), each expert's chain starts at its tokens' rows, reads its slice of
    every bank, and ends at the down bias's add, the one value read outside it (by the router's weighting)."""
    from autotp.passes.loop_banks import bank_loops

    torch.manual_seed(0)
    captured = capture(GatedBankExperts(), (models.tokens(2, 8, 0) % 64,), training=False)
    loops, why = bank_loops(captured.module.graph)
    assert not why and len(loops) == 1 and [c.expert for c in loops[0].chains] == [0, 1, 2, 3]
    assert set(loops[0].banks.values()) == {4} and len(loops[0].banks) == 4
    for chain in loops[0].chains:
        banks = [f"model.{w}" for w in ("gate_up", "gate_up_bias", "down", "down_bias")]
        assert [s.args[0].target for s in chain.selects] == banks
        assert chain.end.target is torch.ops.aten.add.Tensor and chain.end.args[1] in chain.nodes
        assert all(u in chain.nodes for n in chain.nodes if n is not chain.end for u in n.users)
