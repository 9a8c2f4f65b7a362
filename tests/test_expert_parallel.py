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
from autotp.expert_check import full_experts
from autotp.passes.placement import Placement, PlacementKind
from autotp.passes.routed_experts import ExpertLayer
from autotp.planning.expert_layout import NO_BANK, NOT_TP, expert_notes
from autotp.planning.ep_runtime import ep_unrunnable
from autotp.runtime.expert_groups import check_ep_layout, group_members
from autotp.tools import cli
from tests import capture_cache, models
from tests.distributed import run_on_ranks
from tests.ep_workers import (
    BATCH,
    BATCH_DP,
    BUILDERS,
    HIDDEN,
    SEQ,
    TOP_K,
    _batch,
    expert_parallel,
    expert_parallel_over_dp,
    loop_experts,
    one_token_batch,
    to_first_experts,
    with_pipeline,
)
from tests.moe_workers import PLANNED, deepseek, mixtral


def _ids():
    return models.tokens(2, 8, 0)


@pytest.fixture(scope="module")
def warmed():
    """Mixtral, and Mixtral routing every token to the first experts, captured here before the ranks fork, as the
    workers build them: the ranks of both gloo tests below find their eval-mode graphs captured (each spawn's ranks
    would otherwise capture them again). Their train-mode graphs are captured again in the ranks: the first forward
    installs transformers' router-logit hooks, so the warmed model no longer equals a fresh one."""
    before = capture_cache.sources()
    for skewed in (False, True):
        torch.manual_seed(0)
        model = BUILDERS["mixtral"]()
        capture_cache.warm(to_first_experts(model) if skewed else model, _batch(1))
    yield
    # the warmed models carry the router-logit hooks their first forward installed: a later file's equal model
    # must not be served graphs reading their tensors
    capture_cache.forget(capture_cache.sources() - before)


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


@pytest.mark.parametrize("build", [mixtral, deepseek, BUILDERS["mixtral loop"]], ids=["mixtral", "deepseek", "loop"])
def test_each_rank_holds_whole_experts_and_the_routed_rows_are_dispatched_and_combined(build):
    """DeepSeek-V3's router first picks among groups of experts: its experts are counted from the widest top-k;
    its shared expert keeps its tensor-parallel split. A loop over the experts lists the collectives of grouped
    matmuls: all its experts' rows travel together."""
    torch.manual_seed(0)
    plan = autotp.plan(build(), tp=2, ep=2, vocab="whole", example_inputs=(_ids(),))
    assert _expert_split(plan) == [f"model.layers.{i}.mlp.experts.{w}" for i in (0, 1)
                                   for w in ("down_proj", "gate_up_proj")]
    notes = [n for n in plan.notes if "ep=2" in n]
    assert [n.split(":")[0] for n in notes] == ["model.layers.0.mlp", "model.layers.1.mlp"]
    assert all("4 routed experts (top-2" in n and "2 whole experts each" in n for n in notes), notes
    for layer in (0, 1):
        routed = sorted((c.op.value, c.direction.value, c.operator.value, c.shape) for c in plan.collectives
                        if c.module.startswith(f"model.layers.{layer}.mlp.experts"))
        share, rows = ("B*T", "64"), (f"{TOP_K}*B*T", "64")  # a tp rank's share of the routed rows; all of them
        assert routed == [("all_gather", "backward", "scatter", rows), ("all_gather", "forward", "gather", rows),
                          ("all_gather", "forward", "route", ("2", "4")),
                          ("all_to_all", "backward", "combine", share), ("all_to_all", "backward", "dispatch", share),
                          ("all_to_all", "forward", "combine", share), ("all_to_all", "forward", "dispatch", share)]


def test_gpt_oss_interleaved_bank_is_expert_split_with_its_biases_dispatched_with_their_rows():
    """GPT-OSS adds each expert's bias, picked per row, in place to its grouped matmul's rows: the banks are split by
    their experts, the biases kept whole, and the bias rows dispatched with the rows they are added to (its
    exactness: ``test_moe_models_at_ep_are_exact_in_the_checker``)."""
    torch.manual_seed(0)
    plan = autotp.plan(PLANNED["gpt_oss"](), tp=2, ep=2, example_inputs=(_ids(),))
    experts = {n: p.kind.value for n, p in plan.placements.items() if ".mlp.experts." in n}
    assert experts == {f"model.layers.{i}.mlp.experts.{w}": kind for i in (0, 1)
                       for w, kind in (("gate_up_proj", "expert"), ("down_proj", "expert"),
                                       ("gate_up_proj_bias", "replicated"), ("down_proj_bias", "replicated"))}
    assert sum("2 whole experts each" in n for n in plan.notes) == 2, plan.notes


def test_a_dense_model_at_ep_says_there_is_nothing_to_divide():
    plan = autotp.plan(models.build("gpt"), tp=2, ep=2, example_inputs=(_ids(),))
    assert any("no mixture-of-experts router" in n for n in plan.notes), plan.notes


@pytest.mark.parametrize("name", sorted(PLANNED))
def test_moe_models_at_ep_are_exact_in_the_checker(name):
    torch.manual_seed(0)
    report = autotp.check(PLANNED[name](), tp=2, ep=2, example_inputs=(_ids(),))
    assert report.exact, report


def test_qwen3_moe_with_its_auxiliary_loss_is_exact_in_the_checker():
    """Qwen3-MoE's bank (indexed per expert by transformers 5.x's grouped matmuls), its router's auxiliary loss
    in the model's loss."""
    import transformers

    config = transformers.Qwen3MoeConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                         moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                                         num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
                                         output_router_logits=True, router_aux_loss_coef=0.5)
    torch.manual_seed(0)
    ids = _ids()
    report = autotp.check(transformers.Qwen3MoeForCausalLM(config), tp=2, ep=2,
                          example_inputs={"input_ids": ids, "labels": ids})
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


def test_ep_trains_exactly_on_two_ranks_and_dispatches_top_k_rows_per_layer_by_all_to_all(warmed):
    """Outputs, the losses of 2 AdamW steps (the auxiliary router loss included) and every parameter after them;
    each rank holds 2 of the 4 experts of every bank; also with every token routed to the first rank's experts
    (the second rank's get none, yet run the same collectives). Counted at run time, each MoE layer's dispatch and
    combine all-to-alls carry top-k x tokens x hidden over the ranks, each way; no all-reduce over the experts'
    outputs (the all-reduces are those of ep=1 less the experts' own); every other byte counted is one the plan
    lists."""
    ranks = run_on_ranks(expert_parallel, 2)
    for rank in ranks:
        for name in ("mixtral", "deepseek", "mixtral to one rank"):
            r = rank[name]
            assert r["output"] < 1e-5 and max(r["losses"]) < 1e-5 and r["params"] < 1e-5, (name, r)
            assert len(r["expert_split"]) == 4 and set(r["local_experts"].values()) == {2} and not r["missing"], (name, r)
        at_one, at_two = rank["bytes"]["ep=1"], rank["bytes"]["ep=2"]
        for d in ("forward", "backward"):
            assert at_two["counted"][f"all_reduce {d}"] == at_two["listed"][f"all_reduce {d}"], (d, at_two)
            # the step's own checks (the batch agreed on) all-gather a few bytes the plan does not list, at any ep
            unlisted = [at["counted"][f"all_gather {d}"] - at["listed"][f"all_gather {d}"] for at in (at_one, at_two)]
            assert unlisted[0] == unlisted[1], (d, at_one, at_two)
        assert "all_reduce" not in {op for op, _, _ in at_two["expert"]}, at_two["expert"]
    rows = TOP_K * BATCH * SEQ * HIDDEN * 4
    for d in ("forward", "backward"):
        # two layers, a dispatch and a combine each: every routed row once each way, whatever the routing
        assert sum(r["bytes"]["ep=2"]["counted"][f"all_to_all {d}"] for r in ranks) == 2 * 2 * rows
        assert sum(r["bytes"]["ep=2"]["listed"][f"all_to_all {d}"] for r in ranks) == 2 * 2 * rows
        at_one, at_two = (ranks[0]["bytes"][k]["counted"][f"all_reduce {d}"] for k in ("ep=1", "ep=2"))
        assert at_two < at_one, (d, at_one, at_two)


def test_ep_over_data_parallel_ranks_trains_exactly_by_all_to_all(warmed):
    """tp=1, dp=2, ep=2: each replica holds half the experts and routes its own tokens to both ranks' experts;
    outputs, the losses of 2 AdamW steps (the auxiliary router loss included) and every parameter after them equal
    the unsharded model trained on the replicas' mean loss, also with every token routed to the first rank's
    experts. Each all-to-all carries every routed row of both replicas once, each way; full_state_dict gathers the
    experts over their ep group (sharded checkpoints: tests/test_ep_checkpoint.py)."""
    configs = [("mixtral", 1, 2, 2, False), ("mixtral", 1, 2, 2, True)]
    ranks = run_on_ranks(expert_parallel_over_dp, 2, configs)
    for rank in ranks:
        for label, r in rank.items():
            assert r["output"] < 1e-5 and max(r["losses"]) < 1e-5 and r["params"] < 1e-5, (label, r)
            assert max(r["norms"]) < 1e-5 and r["local_experts"] == [2], (label, r)
    rows = TOP_K * BATCH_DP * SEQ * HIDDEN * 4  # both replicas' routed rows
    for label in ranks[0]:
        for d in ("forward", "backward"):
            assert sum(rank[label]["all_to_all"][d] for rank in ranks) == 2 * 2 * rows, (label, d)


def _loop_trains_exactly(tp: int) -> None:
    ranks = run_on_ranks(loop_experts, 2, (tp,))
    for rank in ranks:
        for label, r in rank.items():
            assert r["output"] < 1e-5 and r["one token"] < 1e-5 and max(r["losses"]) < 1e-5, (label, r)
            assert r["params"] < 1e-5 and max(r["norms"]) < 1e-5 and r["local_experts"] == [2], (label, r)
    rows = TOP_K * BATCH_DP * SEQ * HIDDEN * 4  # every replica's routed rows
    for d in ("forward", "backward"):
        assert sum(rank[f"tp={tp} dp={2 // tp}"]["all_to_all"][d] for rank in ranks) == 2 * 2 * rows, d


def test_a_loop_over_the_experts_hit_is_expert_split_and_trains_exactly_over_data_parallel_ranks():
    """transformers' eager experts (a loop over the experts hit, ``W[e]`` per expert), captured from a batch routing
    each layer's tokens to 2 of its 4 experts: every expert is reached all the same. At tp=1, dp=2, ep=2: outputs
    (on batches routing to every expert, and on one routing every token to the same two), the losses of 2 AdamW
    steps (the auxiliary router loss included), gradient norms and every parameter after them equal the unsharded
    model's; each rank holds 2 of each bank's 4 experts. Counted at run time, each layer's dispatch and combine
    carry every routed row once each way. (tp=2, ep=2: the checker below, and on gloo under -m slow.)"""
    _loop_trains_exactly(1)


@pytest.mark.slow  # about 2 minutes on 2 busy cores; the checker covers tp=2, ep=2 by default
def test_a_loop_over_the_experts_hit_trains_exactly_at_ep_over_tp():
    _loop_trains_exactly(2)


def test_a_loop_over_the_experts_hit_is_exact_in_the_checker_at_ep_above_tp():
    """The checker simulates dp x tp ranks at ep above tp (here tp=2 x dp=2, one expert per rank), the loop captured
    from a batch routing every token to the same 2 experts and checked on a batch routing to all 4."""
    torch.manual_seed(0)
    model = BUILDERS["mixtral loop"]()
    plan = autotp.plan(model, tp=2, dp=2, ep=4, dp_mode="replicate", example_inputs=one_token_batch())
    assert len(_expert_split(plan)) == 4, plan.notes
    report = autotp.check(model, plan=plan, example_inputs=_batch(1))
    assert report.exact, report


def test_the_checker_at_ep_above_tp_refuses_recompute_saying_where_it_checks_it():
    torch.manual_seed(0)
    with pytest.raises(InputError, match="simulates ep above tp without recompute; check recompute at ep = tp"):
        autotp.check(mixtral(), tp=1, dp=2, ep=2, dp_mode="replicate", recompute="blocks",
                     example_inputs=(_ids(),))


def test_the_checker_at_ep_above_tp_sums_each_experts_gradient_over_its_groups_and_averages_over_dp():
    """Each ep group's bank laid end to end in ep-rank order, summed over the groups, divided by dp (every replica
    runs the same example): the reduction the runtime makes."""
    plan = autotp.plan(mixtral(), tp=1, dp=4, ep=2, dp_mode="replicate", example_inputs=(_ids(),))
    name = _expert_split(plan)[0]
    per_rank = [{name: torch.full((2, 1), float(r))} for r in range(4)]  # (dp, tp) order, ep groups of 2
    assert full_experts(plan, per_rank, name).flatten().tolist() == [0.5] * 2 + [1.0] * 2  # (0+2)/4, (1+3)/4


@pytest.mark.slow  # about 3 minutes on 2 cores: the 2-rank tests cover ep over tp and over dp by default
def test_ep_over_tensor_and_data_parallel_ranks_on_four_ranks():
    """On 4 ranks: tp=2 x dp=2 with ep=4 (one expert per rank, each tp rank dispatching its half of the rows),
    tp=1 x dp=4 with ep=2 (each expert held by two replicas, which sum its gradient) and DeepSeek-V3 (shared expert,
    grouped router) at tp=2 x dp=2 with ep=4, and tp=1 x dp=4 with ep=2 under fsdp (the experts whole, their
    gradients summed over their two holders): exact as on 2 ranks, gradient norms included, and every routed row
    crosses once each way."""
    configs = [("mixtral", 2, 2, 4, False), ("mixtral", 1, 4, 2, False), ("deepseek", 2, 2, 4, False),
               ("mixtral", 1, 4, 2, False, "fsdp")]
    ranks = run_on_ranks(expert_parallel_over_dp, 4, configs)
    for rank in ranks:
        for label, r in rank.items():
            assert r["output"] < 1e-5 and max(r["losses"]) < 1e-5 and r["params"] < 1e-5, (label, r)
            assert max(r["norms"]) < 1e-5 and r["local_experts"] == [4 // int(label.split()[3])], (label, r)
    rows = TOP_K * BATCH_DP * SEQ * HIDDEN * 4
    for label in ranks[0]:
        for d in ("forward", "backward"):
            assert sum(rank[label]["all_to_all"][d] for rank in ranks) == 2 * 2 * rows, (label, d)


@pytest.mark.slow  # about 2 minutes on 2 cores
def test_ep_with_pipeline_stages_trains_exactly():
    """tp=2, pp=2, ep=2 on 4 ranks: each stage's MoE layer holds 2 of its 4 experts per rank and dispatches over its
    tp ranks; 2 AdamW steps over 2 microbatches equal the unsharded model's, losses and every parameter."""
    for rank in run_on_ranks(with_pipeline, 4, 2, 2, 2):
        assert max(rank["losses"]) < 1e-5 and rank["params"] < 1e-5 and rank["local_experts"] == [2], rank


@pytest.mark.slow  # about 2 minutes on 2 cores each
@pytest.mark.parametrize("mode", ["replicate", "fsdp"])
def test_ep_above_tp_with_pipeline_stages_trains_exactly(mode):
    """tp=1, dp=2, pp=2, ep=2 on 4 ranks: each stage dispatches over its own two replicas (its expert-parallel
    group), each holding 2 of the 4 experts (under fsdp the dense layers sharded over the replicas, the experts
    whole); 2 AdamW steps over 2 microbatches equal the unsharded model's."""
    for rank in run_on_ranks(with_pipeline, 4, 1, 2, 2, 2, mode):
        assert max(rank["losses"]) < 1e-5 and rank["params"] < 1e-5 and rank["local_experts"] == [2], rank


def test_each_pipeline_stage_dispatches_over_its_own_data_and_tensor_parallel_ranks():
    """ep above tp with pp: a stage's expert-parallel groups and replica groups are ranks of that stage only."""
    assert group_members(1, dp=2, tp=1, ep=2) == ([[2, 3]], [[2], [3]])
    assert group_members(1, dp=2, tp=2, ep=2) == ([[4, 5], [6, 7]], [[4, 6], [5, 7]])
    assert ep_unrunnable(autotp.Options(tp=1, dp=2, pp=2, ep=2, dp_mode="replicate")) is None
    assert ep_unrunnable(autotp.Options(tp=1, dp=2, pp=2, ep=2, dp_mode="fsdp")) is None


def test_ep_above_tp_is_refused_where_it_cannot_be_exact():
    """FSDP's mixed precision would not cast the experts it leaves whole."""
    with pytest.raises(InputError, match="under dp_mode='fsdp' with mixed_precision is not supported"):
        check_ep_layout(autotp.Options(tp=1, dp=2, ep=2, mixed_precision="bfloat16"))
    check_ep_layout(autotp.Options(tp=1, dp=2, ep=2))  # fsdp leaves the experts whole, reduced over their replicas


def test_the_command_line_takes_ep_and_fixes_it_with_devices(capsys):
    assert cli.main(["plan", "hf:mixtral", "--tp", "2", "--ep", "2"]) == 0
    assert "divided among ep=2 ranks" in capsys.readouterr().out
    assert cli.main(["plan", "hf:mixtral", "--devices", "4", "--ep", "2"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line[:1].isdigit()]
    assert rows and all("ep2" in r and r[r.index("yes") - 10] == "2" for r in rows), rows  # ep, then 9 figures
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
