"""Expert parallelism (``ep``) over the tensor-parallel ranks: each rank holds E/ep whole experts of every bank its
grouped matmuls read and computes their rows only, summed over the ranks (one all-reduce of the routed rows
forward, one of their gradient backward); validated as Megatron's expert-model-parallel group is (ep divides
dp x tp); a layer that cannot be expert-split keeps tensor parallelism, and the plan's notes say why.

Exactness: the one-process checker (outputs, loss, every gradient, parameters after a step) for Mixtral,
DeepSeek-V3 (shared expert, grouped router) and GPT-OSS (kept under tensor parallelism), and 2 gloo ranks
training 2 AdamW steps on the model's own loss, the auxiliary router loss included (``tests/ep_workers.py``)."""

from __future__ import annotations

import pytest
import torch

import autotp
from autotp.errors import InputError, PlanError
from autotp.passes.placement import Placement, PlacementKind
from autotp.passes.routed_experts import ExpertLayer
from autotp.planning.expert_layout import NO_BANK, NOT_TP, expert_notes
from autotp.tools import cli
from tests import models
from tests.distributed import run_on_ranks
from tests.ep_workers import BATCH, BUILDERS, HIDDEN, SEQ, TOP_K, _batch, expert_parallel, to_first_experts
from tests.moe_workers import PLANNED, deepseek, mixtral


def _ids():
    return models.tokens(2, 8, 0)


def _expert_split(plan) -> list[str]:
    return sorted(n for n, p in plan.placements.items() if p.kind is PlacementKind.EXPERT)


def test_ep_must_divide_the_data_and_tensor_parallel_ranks():
    assert autotp.Options(tp=2, ep=2).ep == 2
    assert autotp.Options(tp=2, dp=2, ep=4).ep == 4
    with pytest.raises(InputError, match=r"ep=3 must divide dp x tp = 1 x 2 = 2"):
        autotp.Options(tp=2, ep=3)
    with pytest.raises(InputError, match="ep must be a positive integer"):
        autotp.Options(ep=0)
    options = autotp.Options(tp=2, ep=2)
    assert autotp.Options.from_dict(options.to_dict()) == options


def test_notes_say_where_the_experts_went_and_why():
    layers = (ExpertLayer("m.layers.0.mlp", "m.layers.0.mlp.gate", 4, 2),
              ExpertLayer("m.layers.1.mlp", "m.layers.1.mlp.gate", 6, 2))
    assert expert_notes(layers, 1, 2, set()) == []
    split = expert_notes(layers, 2, 2, {"m.layers.0.mlp.experts.w"})
    assert "divided among ep=2 ranks, 2 whole experts each" in split[0] and NO_BANK in split[1]
    assert "its 4 experts do not divide among ep=3 ranks" in expert_notes(layers, 3, 3, set())[0]
    assert NOT_TP in expert_notes(layers, 2, 4, set())[0]
    assert "no mixture-of-experts router" in expert_notes((), 2, 2, set())[0]


@pytest.mark.parametrize("build", [mixtral, deepseek], ids=["mixtral", "deepseek"])
def test_each_rank_holds_whole_experts_and_the_routed_rows_are_summed_once_each_way(build):
    """DeepSeek-V3's router first picks among groups of experts: its experts are counted from the widest top-k;
    its shared expert keeps its tensor-parallel split."""
    torch.manual_seed(0)
    plan = autotp.plan(build(), tp=2, ep=2, vocab="whole", example_inputs=(_ids(),))
    assert _expert_split(plan) == [f"model.layers.{i}.mlp.experts.{w}" for i in (0, 1)
                                   for w in ("down_proj", "gate_up_proj")]
    notes = [n for n in plan.notes if "ep=2" in n]
    assert [n.split(":")[0] for n in notes] == ["model.layers.0.mlp", "model.layers.1.mlp"]
    assert all("4 routed experts (top-2" in n and "2 whole experts each" in n for n in notes), notes
    for layer in (0, 1):
        routed = sorted((c.direction.value, c.operator.value, c.shape) for c in plan.collectives
                        if c.module.startswith(f"model.layers.{layer}.mlp.experts"))
        assert routed == [("backward", "f", (f"{TOP_K}*B*T", "64")), ("forward", "g", (f"{TOP_K}*B*T", "64"))]


def test_experts_that_cannot_be_split_exactly_keep_tensor_parallelism_with_a_note():
    """GPT-OSS adds each expert's bias in place to its rows: kept under tensor parallelism, exactly as at ep=1."""
    torch.manual_seed(0)
    at_one = autotp.plan(PLANNED["gpt_oss"](), tp=2, example_inputs=(_ids(),))
    torch.manual_seed(0)
    at_two = autotp.plan(PLANNED["gpt_oss"](), tp=2, ep=2, example_inputs=(_ids(),))
    assert (at_two.placements, at_two.collectives) == (at_one.placements, at_one.collectives)
    added = [n for n in at_two.notes if n not in at_one.notes]
    assert len(added) == 2 and all("kept under tensor parallelism at ep=2" in n and "in place" in n for n in added)


def test_a_dense_model_at_ep_says_there_is_nothing_to_divide():
    plan = autotp.plan(models.build("gpt"), tp=2, ep=2, example_inputs=(_ids(),))
    assert any("no mixture-of-experts router" in n for n in plan.notes), plan.notes


@pytest.mark.parametrize("name", sorted(PLANNED))
def test_moe_models_at_ep_are_exact_in_the_checker(name):
    torch.manual_seed(0)
    report = autotp.check(PLANNED[name](), tp=2, ep=2, example_inputs=(_ids(),))
    assert report.exact, report


def test_one_expert_per_rank_at_ep_4_is_exact_in_the_checker():
    torch.manual_seed(0)
    report = autotp.check(mixtral(), tp=4, ep=4, example_inputs=(_ids(),))
    assert report.exact, report


def test_ranks_whose_experts_get_no_token_are_exact_in_the_checker():
    """Every token routed to the first rank's experts: the other rank's grouped matmuls have no rows, yet its
    output still reaches its inputs in autograd, so it runs the same all-reduces backward."""
    torch.manual_seed(0)
    model = to_first_experts(BUILDERS["mixtral"]())
    report = autotp.check(model, tp=2, ep=2, example_inputs=_batch(1))
    assert report.exact, report


def test_ep_trains_exactly_on_two_ranks_and_moves_top_k_rows_per_layer():
    """Outputs, the losses of 2 AdamW steps (the auxiliary router loss included) and every parameter after them;
    each rank holds 2 of the 4 experts of every bank; also with every token routed to the first rank's experts
    (the second rank's get none, yet run the same collectives). Counted at run time, each MoE layer's all-reduces carry
    top-k x tokens x hidden each way where tensor parallelism's carry the tokens' hidden state forward and it and
    the routing weights backward; every byte counted is one the plan lists."""
    for rank in run_on_ranks(expert_parallel, 2):
        for name in ("mixtral", "deepseek", "mixtral to one rank"):
            r = rank[name]
            assert r["output"] < 1e-5 and max(r["losses"]) < 1e-5 and r["params"] < 1e-5, (name, r)
            assert len(r["expert_split"]) == 4 and set(r["local_experts"].values()) == {2} and not r["missing"], (name, r)
        at_one, at_two = rank["bytes"]["ep=1"], rank["bytes"]["ep=2"]
        for counted in (at_one, at_two):
            assert counted["counted"] == counted["listed"], counted
        rows, tokens = TOP_K * BATCH * SEQ * HIDDEN * 4, BATCH * SEQ * HIDDEN * 4
        assert at_two["counted"]["forward"] - at_one["counted"]["forward"] == 2 * (rows - tokens)
        assert at_two["counted"]["backward"] - at_one["counted"]["backward"] == \
            2 * (rows - tokens - TOP_K * BATCH * SEQ * 4)


def test_the_command_line_takes_ep_and_fixes_it_with_devices(capsys):
    assert cli.main(["plan", "hf:mixtral", "--tp", "2", "--ep", "2"]) == 0
    assert "divided among ep=2 ranks" in capsys.readouterr().out
    assert cli.main(["plan", "hf:mixtral", "--devices", "4", "--ep", "2"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line[:1].isdigit()]
    assert rows and all("ep2" in r and r[r.index("yes") - 9] == "2" for r in rows), rows
    assert cli.main(["plan", "hf:mixtral", "--tp", "2", "--ep", "3"]) != 0
    assert "ep=3 must divide" in capsys.readouterr().err


def test_an_ep_plan_file_round_trips_and_a_misplaced_expert_split_is_refused():
    """The plan's JSON keeps the banks' placements (and the experts' all-reduces are recomputed from them); an
    ``expert`` placement on anything but a bank of grouped matmuls would compute wrong experts, so it is refused."""
    torch.manual_seed(0)
    model = mixtral()
    plan = autotp.plan(model, tp=2, ep=2, example_inputs=(_ids(),))
    loaded = autotp.Plan.from_json(plan.to_json())
    assert _expert_split(loaded) == _expert_split(plan)
    assert autotp.check(model, plan=loaded, example_inputs=(_ids(),)).exact
    query = "model.layers.0.self_attn.q_proj.weight"
    bad = plan.replace(placements={**plan.placements, query: Placement(PlacementKind.EXPERT, dim=0)})
    with pytest.raises(PlanError, match=f"{query} is placed 'expert'"):
        autotp.check(model, plan=bad, example_inputs=(_ids(),))
