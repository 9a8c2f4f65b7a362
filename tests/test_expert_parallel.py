"""The ``ep`` setting (expert parallelism): validated as Megatron's expert-model-parallel group is (it divides
dp x tp), taken by ``plan``, ``check`` and the command line, and recorded in the plan; each mixture-of-experts
layer, found from its router, is named in the plan's notes with why its experts stay under tensor parallelism,
and the plan stays the exact tensor-parallel one (never a plan that reads as expert-split when it is not)."""

from __future__ import annotations

import pytest
import torch

import autotp
from autotp.errors import InputError
from autotp.passes.routed_experts import ExpertLayer
from autotp.planning.expert_split import NOT_YET, expert_notes
from autotp.tools import cli
from tests import models
from tests.moe_workers import TOP_K, deepseek, mixtral


def _ids():
    return models.tokens(2, 8, 0)


def test_ep_must_divide_the_data_and_tensor_parallel_ranks():
    assert autotp.Options(tp=2, ep=2).ep == 2
    assert autotp.Options(tp=2, dp=2, ep=4).ep == 4
    with pytest.raises(InputError, match=r"ep=3 must divide dp x tp = 1 x 2 = 2"):
        autotp.Options(tp=2, ep=3)
    with pytest.raises(InputError, match="ep must be a positive integer"):
        autotp.Options(ep=0)
    options = autotp.Options(tp=2, ep=2)
    assert autotp.Options.from_dict(options.to_dict()) == options


def test_notes_name_each_layer_and_why_its_experts_stay_split_by_tensor_parallelism():
    layers = (ExpertLayer("m.layers.0.mlp", "m.layers.0.mlp.gate", 4, 2),
              ExpertLayer("m.layers.1.mlp", "m.layers.1.mlp.gate", 6, 2))
    assert expert_notes(layers, 1) == []
    two, three = expert_notes(layers, 2), expert_notes(layers, 3)
    assert [NOT_YET in n for n in two] == [True, True]
    assert "its 4 experts do not divide among ep=3 ranks" in three[0] and NOT_YET in three[1]
    assert "no mixture-of-experts router" in expert_notes((), 2)[0]


@pytest.mark.parametrize("build", [mixtral, deepseek], ids=["mixtral", "deepseek"])
def test_the_plan_at_ep_finds_every_routed_layer_and_keeps_the_exact_tensor_parallel_split(build):
    """DeepSeek-V3's router first picks among groups of experts: the experts are counted from the widest top-k."""
    torch.manual_seed(0)
    at_one = autotp.plan(build(), tp=2, example_inputs=(_ids(),))
    torch.manual_seed(0)
    at_two = autotp.plan(build(), tp=2, ep=2, example_inputs=(_ids(),))
    assert at_two.options.ep == 2
    assert (at_two.placements, at_two.collectives) == (at_one.placements, at_one.collectives)
    added = [n for n in at_two.notes if n not in at_one.notes]
    assert [n.split(":")[0] for n in added] == ["model.layers.0.mlp", "model.layers.1.mlp"]
    assert all(f"4 routed experts (top-{TOP_K}" in n and NOT_YET in n for n in added), added


def test_a_dense_model_at_ep_says_there_is_nothing_to_divide():
    plan = autotp.plan(models.build("gpt"), tp=2, ep=2, example_inputs=(_ids(),))
    assert any("no mixture-of-experts router" in n for n in plan.notes), plan.notes


def test_check_at_ep_is_exact():
    torch.manual_seed(0)
    report = autotp.check(mixtral(), tp=2, ep=2, example_inputs=(_ids(),))
    assert report.exact, report


def test_the_command_line_takes_ep_and_refuses_it_with_devices(capsys):
    assert cli.main(["plan", "hf:mixtral", "--tp", "2", "--ep", "2"]) == 0
    assert "kept under tensor parallelism at ep=2" in capsys.readouterr().out
    assert cli.main(["plan", "hf:mixtral", "--devices", "4", "--ep", "2"]) != 0
    assert "does not price expert parallelism" in capsys.readouterr().err
    assert cli.main(["plan", "hf:mixtral", "--tp", "2", "--ep", "3"]) != 0
    assert "ep=3 must divide" in capsys.readouterr().err
