"""Dense convolutions split as projections of their channels (column then row), with batch norms, depthwise
convolutions and pooling keeping the channel split between them: each structure checked exact by autotp.check
(outputs, gradients, parameters and running statistics after a step) at tp=2 and 4."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

import autotp
from autotp.capture import capture
from autotp.checker import check_prepared, prepare
from autotp.options import Options
from autotp.passes.steps import Operator
from autotp.planning import make_plan
from autotp.rewrite import rewrite
from tests import conv_models
from tests.distributed import on_threads


_checked, _split = conv_models.checked_plan, conv_models.split_kinds


@pytest.mark.parametrize("tp", [2, 4])
def test_a_bottleneck_with_batch_norm_in_training_is_exact(tp):
    torch.manual_seed(0)
    plan = _checked(conv_models.Bottleneck().train(), tp, (torch.randn(2, 32, 6, 6),))
    split = _split(plan)
    assert split["conv1.weight"] == "colwise" and split["bn1.weight"] == "colwise"
    assert split["conv2.weight"] == "rowwise"
    # training updates bn1's running statistics, per rank for its channels: all-gathered into every rank's buffers
    assert any(c.operator is Operator.RUNNING_STATS for c in plan.collectives)


@pytest.mark.parametrize("tp", [2, 4])
def test_an_inverted_residual_splits_its_depthwise_convolution(tp):
    torch.manual_seed(0)
    plan = _checked(conv_models.InvertedResidual().train(), tp, (torch.randn(2, 16, 6, 6),))
    split = _split(plan)
    assert (split["expand.weight"], split["depthwise.weight"], split["bn2.bias"]) == ("colwise",) * 3
    assert split["project.weight"] == "rowwise"
    assert not [n for n in plan.notes if "depthwise kept whole" in n]


@pytest.mark.parametrize("tp", [2, 4])
def test_a_whisper_style_front_end_splits_both_convolutions(tp):
    torch.manual_seed(0)
    plan = _checked(conv_models.SpeechFrontEnd(), tp, (torch.randn(2, 8, 16),))
    split = _split(plan)
    # conv2's bias is added once, after the all-reduce of its partial sums
    assert (split["conv1.weight"], split["conv1.bias"], split["conv2.weight"]) == ("colwise", "colwise", "rowwise")
    assert "conv2.bias" not in split


def test_batch_norm_in_evaluation_reads_its_slice_of_the_running_statistics():
    torch.manual_seed(0)
    model, x = conv_models.Bottleneck().eval(), torch.randn(2, 32, 6, 6)
    model.bn1.running_mean.normal_(), model.bn1.running_var.uniform_(0.5, 2)
    cap = capture(model, (x,), training=False)
    plan = make_plan(cap, Options(tp=2))
    assert _split(plan)["bn1.weight"] == "colwise"
    assert not any(c.operator is Operator.RUNNING_STATS for c in plan.collectives)  # evaluation updates none
    outputs = on_threads(2, lambda comm: rewrite(cap, plan, comm.rank, comm)(x))
    for out in outputs:
        assert_close(out, model(x))


def test_a_group_norm_cutting_its_groups_sees_its_input_whole():
    torch.manual_seed(0)
    model = conv_models.ConvLM(vocab=32)
    model.norm = torch.nn.GroupNorm(2, model.norm.num_channels)  # 2 groups over 4 ranks: a rank would hold half a group
    plan = _checked(model, 4, (torch.randint(0, 32, (2, 8)),))
    assert "norm.weight" not in _split(plan)


@pytest.fixture(scope="module")
def resnet():
    from devtools import zoo

    entry, = zoo.entries({"resnet:image"})
    torch.manual_seed(0)
    model = entry.build()
    return model, prepare(model, entry.inputs(model))  # captured once for both tps


@pytest.mark.parametrize("tp", [2, 4])
def test_transformers_tiny_resnet_is_exact(resnet, tp):
    model, prepared = resnet
    torch.manual_seed(0)
    report = check_prepared(prepared, tp)
    assert report.exact, report.mismatch
    convolutions = [n for n, p in model.named_parameters() if n.endswith("convolution.weight")]
    split = [n for n in convolutions if n in _split(report.plan)]
    assert len(split) >= len(convolutions) - 1, sorted(set(convolutions) - set(split))  # all but the stem


def test_convolution_regions_are_named_so_and_not_exported_as_linear_styles():
    from autotp.passes.region_match import RegionKind
    from autotp.tools.exports import to_hf_tp_plan

    torch.manual_seed(0)
    plan = autotp.plan(conv_models.Bottleneck(), 2, (torch.randn(2, 32, 6, 6),))
    region, = [r for r in plan.regions if "conv1" in r.columns]
    assert region.kind is RegionKind.CONVOLUTION and region.rows == ("conv2",)
    # HF's colwise/rowwise would shard conv1 and conv2 but not bn1 between them: left out, never half-exported
    assert to_hf_tp_plan(plan, strict=False) == {}


def test_channels_that_do_not_divide_by_tp_keep_their_convolutions_whole_with_a_note():
    torch.manual_seed(0)
    plan = _checked(conv_models.Bottleneck(mid=6).train(), 4, (torch.randn(2, 32, 6, 6),))  # 6 channels, 4 ranks
    assert "conv1.weight" not in _split(plan)
    assert any(n.startswith("conv1 kept whole: a dense convolution") and "do not divide by tp=4" in n
               for n in plan.notes), plan.notes


@pytest.mark.parametrize("tp", [2, 4])
def test_a_convolution_with_its_padding_given_as_a_word_is_split_too(tp):
    model = conv_models.Bottleneck().train()
    model.conv2.padding = "same"  # aten.conv2d.padding, the overload SigLIP's patch embedding ("valid") exports as
    plan = _checked(model, tp, (torch.randn(2, 32, 6, 6),))
    assert (_split(plan)["conv1.weight"], _split(plan)["conv2.weight"]) == ("colwise", "rowwise")


@pytest.mark.parametrize("tp", [2, 4])
def test_a_weight_normed_grouped_convolution_over_the_residual_splits_by_whole_groups(tp):
    """wav2vec2's positional convolution: its whole input sliced by this rank's groups, its weight's parameter split
    along the output channels, the norm's sum of squares over them all-reduced (the gain kept whole)."""
    torch.manual_seed(0)
    plan = _checked(conv_models.PositionalConvLM(50), tp, (torch.randint(0, 50, (2, 8)),))
    split = _split(plan)
    assert split["pos_conv.parametrizations.weight.original1"] == "colwise"
    assert split["pos_conv.bias"] == "colwise"
    assert not plan.placements["pos_conv.parametrizations.weight.original0"].is_split
    assert any(c.operator is Operator.G and "pos_conv" in c.module for c in plan.collectives)


def test_a_grouped_convolution_whose_groups_tp_does_not_divide_is_kept_whole_with_a_note():
    torch.manual_seed(0)
    model = conv_models.PositionalConvLM(50, dim=24, groups=3)
    plan = _checked(model, 2, (torch.randint(0, 50, (2, 8)),))
    assert not plan.placements["pos_conv.parametrizations.weight.original1"].is_split
    assert any("pos_conv kept whole: a grouped convolution" in n for n in plan.notes), plan.notes


class _PositionsReadTwice(conv_models.PositionalConvLM):
    """The positional convolution's output read twice by whole values (added to the stream, and a softmax over
    its channels gating it): split by groups it would be made whole twice a step."""

    def forward(self, ids):
        x = self.embed(ids)
        positions = self.pos_conv(x.transpose(1, 2))[:, :, :-1]
        gate = torch.softmax(positions, dim=1).transpose(1, 2)
        x = self.norm(x + positions.transpose(1, 2)) * gate
        return self.head(x + self.down(torch.nn.functional.gelu(self.up(x))))


def test_a_weight_normed_grouped_convolution_gathered_twice_is_kept_whole_by_choice_with_a_note():
    """As the openings keep a grouped convolution whose split would only be gathered again: a choice (a cost), in
    ``Plan.by_choice`` and a note, where a weight-normed one (SEW-D's) was kept whole with no word."""
    torch.manual_seed(0)
    plan = _checked(_PositionsReadTwice(50), 2, (torch.randint(0, 50, (2, 8)),))
    assert not plan.placements["pos_conv.parametrizations.weight.original1"].is_split
    assert "pos_conv" in plan.by_choice, plan.by_choice
    assert any(n.startswith("pos_conv kept whole by choice: a grouped convolution") and "2 times" in n
               for n in plan.notes), plan.notes
