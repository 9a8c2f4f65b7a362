"""The layout search prices expert parallelism (``planning.expert_cost``) against tensor-splitting the experts:
all-to-all communication over the ep group's link, E/ep whole experts per rank, and the expert matmuls' tile
efficiency at the routing's expected load. Pure functions over hand-made profiles of H100s (no capture), then
one tiny Mixtral's profile from its graph; ``parallelize`` refuses a searched ep the runtime cannot run yet."""

from __future__ import annotations

import pytest
import torch

import autotp
from autotp.errors import PlanError
from autotp.passes.steps import CollectiveOp
from autotp.planning.expert_cost import MoeLayer, ep_sizes, expert_rows_cols, tile_efficiency
from autotp.planning.ep_runtime import ep_unrunnable, refuse_unrunnable_ep
from autotp.planning.layout_cost import Layout, Profile, predict
from autotp.planning.layout_search import profile_of, rank_layouts
from autotp.planning.machines import MACHINES
from autotp.planning.plan_file import check_plan_data
from tests import models

H100 = MACHINES["h100"]
SEQ = 4096


def _moe(tp: int, experts: int, top_k: int, width: int, hidden: int, sequences: int, layers: int = 4) -> Profile:
    """One unit of ``layers`` MoE layers (SwiGLU experts: 3 matrices of hidden x width) and an attention's worth of
    dense weights each, for ``sequences`` of SEQ tokens, bf16, at ``tp``: the routed experts split by tp."""
    tokens, whole = sequences * SEQ, experts * 3 * hidden * width
    moe = tuple(MoeLayer(0, experts, top_k, hidden, width, float(whole), whole / tp, float(tokens))
                for _ in range(layers))
    dense = layers * 4 * hidden * hidden
    compute = sum(m.flops for m in moe) / tp + 2 * tokens * dense / tp
    collectives = ((CollectiveOp.ALL_REDUCE, 4.0 * tokens * hidden * 2 * layers, 0),) if tp > 1 else ()
    return Profile(tp, False, (compute,), ((layers * whole + dense) / tp,), (tokens * hidden * 20.0 * layers / tp,),
                   (), collectives, 2, False, (100.0 * layers,), (), moe=moe)


def _search(world: int, sequences: int, fixed=None, **moe):
    profiles = [_moe(tp, sequences=sequences, **moe) for tp in (1, 2, 4, 8)]
    return rank_layouts(profiles, world, sequences, fixed or {}, H100, None, every=True)  # the pricing alone


MIXTRAL = dict(experts=8, top_k=2, width=14336, hidden=4096)
"""Few wide experts (Mixtral 8x7B's widths)."""
FINE = dict(experts=256, top_k=8, width=512, hidden=4096)
"""Many narrow experts: split by tp=8 each is 64 wide, under an H100's 128-wide tile."""


def test_ep_divides_dp_x_tp_and_every_layers_experts():
    layer = MoeLayer(0, 8, 2, 64, 64, 1e6, 5e5, 1e3)
    assert ep_sizes((layer,), 2, 4) == [1, 2, 4, 8]
    assert ep_sizes((layer, MoeLayer(1, 4, 2, 64, 64, 1e6, 5e5, 1e3)), 2, 4) == [1, 2, 4]
    assert ep_sizes((), 2, 4) == [1]  # a dense model: nothing to divide
    assert ep_sizes((layer,), 2, 4, fixed=4) == [4] and ep_sizes((layer,), 2, 4, fixed=3) == []


def test_expert_matmuls_under_tp_are_narrow_and_under_ep_whole():
    layer = MoeLayer(0, 256, 8, 4096, 512, 1.0, 1.0, 8 * SEQ)
    # A replica's 4096 tokens per microbatch route 4096 x 8 / 256 = 128 rows to each expert.
    assert expert_rows_cols(layer, tp=8, ep=1, replicas=8, microbatches=1) == (128, 64)
    assert expert_rows_cols(layer, tp=8, ep=8, replicas=8, microbatches=1) == (128, 512)
    assert tile_efficiency(128, 64, 128) == 0.5 and tile_efficiency(128, 512, 128) == 1.0
    assert tile_efficiency(1, 1, 1) == 1.0  # CPUs: no tile


def test_ep_holds_whole_experts_and_trades_their_gradient_reduction_for_all_to_alls():
    """At tp=1 over 8 data-parallel ranks, ep=8 holds an eighth of the experts (their states: 4 copies) and
    reduces none of their gradients, and pays 4 all-to-alls per layer of top-k x tokens x hidden each."""
    profile = _moe(1, sequences=8, **MIXTRAL)
    dp, ep = predict(profile, Layout(1, 1, 8, "replicate"), [0], H100, None), \
        predict(profile, Layout(1, 1, 8, "replicate", ep=8), [0], H100, None)
    experts = sum(m.params for m in profile.moe)
    assert dp.memory - ep.memory == pytest.approx(experts * (1 - 1 / 8) * 2 * 4, rel=1e-6)
    assert dp.ep_comm == 0 and ep.ep_comm > 0 and ep.dp_comm < dp.dp_comm / 10
    local = 2 * 8 * SEQ / 8 * 4096 * 2  # top-k x the rank's tokens x hidden x bf16
    assert ep.ep_comm == pytest.approx(4 * 4 * H100.node.all_to_all(local, 8), rel=1e-9)
    assert ep.step_time < dp.step_time and ep.layout.label() == "tp1 ep8 pp1 dp8 replicate"


def test_the_search_picks_ep_over_data_parallel_ranks_for_many_experts():
    chosen = _search(64, 64, **FINE)[0]
    assert chosen.layout.ep > 1 and chosen.ep_comm > 0, chosen
    assert _search(64, 64, **MIXTRAL)[0].layout.ep > 1


def test_the_search_keeps_wide_experts_under_tp_when_there_is_no_data_parallelism():
    """One sequence: no data-parallel ranks, so ep can only be taken from tp's, where the experts are already
    divided; wide experts fill the tiles split by tp, and ep would only add its all-to-alls."""
    ranked = _search(8, 1, fixed={"tp": 8}, **MIXTRAL)
    assert ranked[0].layout.ep == 1 and ranked[0].layout.tp == 8, ranked[0]
    at_ep = next(p for p in ranked if p.layout.ep == 8)
    assert at_ep.step_time - ranked[0].step_time == pytest.approx(at_ep.ep_comm, rel=1e-6)


def test_narrow_experts_split_by_tp_are_slow_and_ep_makes_them_whole():
    ranked = _search(8, 1, fixed={"tp": 8}, **FINE)
    assert ranked[0].layout.ep == 8, ranked[0]
    tp_only = next(p for p in ranked if p.layout.ep == 1)
    assert tp_only.compute > ranked[0].compute  # the same FLOPs at half the rate in 64-wide matmuls


def test_a_plan_file_reads_ep_layouts_and_those_written_before_them():
    plan = {"tp": 1, "placements": {}, "layouts": []}
    row = predict(_moe(1, sequences=8, **MIXTRAL), Layout(1, 1, 8, ep=8), [0], H100, None).to_dict()
    assert row["ep"] == 8 and row["ep_comm"] > 0
    check_plan_data(plan | {"layouts": [row]})
    check_plan_data(plan | {"layouts": [{k: v for k, v in row.items() if k not in ("ep", "ep_comm")}]})


def test_parallelize_refuses_a_searched_ep_the_runtime_cannot_run_yet():
    assert ep_unrunnable(autotp.Options(tp=2, ep=2)) is None and ep_unrunnable(autotp.Options(tp=2)) is None
    assert ep_unrunnable(autotp.Options(tp=1, dp=4, ep=4, dp_mode="replicate")) is None  # the all-to-all dispatch
    assert ep_unrunnable(autotp.Options(tp=1, dp=4, ep=4, dp_mode="fsdp")) is None
    assert ep_unrunnable(autotp.Options(tp=1, dp=2, pp=2, ep=2, dp_mode="replicate")) is None
    bf16 = autotp.Options(tp=1, dp=4, ep=4, dp_mode="fsdp", mixed_precision="bfloat16")
    assert "mixed_precision" in ep_unrunnable(bf16)
    assert "multiple of tp" in ep_unrunnable(autotp.Options(tp=4, ep=2))
    with pytest.raises(PlanError, match=r"chose tp=1 pp=1 dp=4 ep=4 for 4 devices.*Fix ep"):
        refuse_unrunnable_ep(bf16, 4)


def test_a_captured_mixtures_layers_are_found_for_the_search():
    """The tiny Mixtral (2 layers, 4 experts of width 128, top-2): each layer's banks, split by tp at ep=1."""
    from autotp.capture import capture, example_inputs_of
    from tests.moe_workers import mixtral

    torch.manual_seed(0)
    model = mixtral()
    captured = capture(model, example_inputs_of(model, (models.tokens(2, 8, 0),)))
    profile = profile_of(captured, autotp.Options(tp=2), H100)
    banks = [p for n, p in model.named_parameters() if "experts" in n]
    assert [(m.experts, m.top_k) for m in profile.moe] == [(4, 2), (4, 2)]
    assert sum(m.params for m in profile.moe) == sum(p.numel() for p in banks)
    assert all(m.rank_params == m.params / 2 and m.tokens == 16 for m in profile.moe)
    assert profile.moe[0].unit < profile.moe[1].unit
