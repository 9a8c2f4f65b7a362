"""Grouped convolutions that read a whole value: a region opens at one whose split output only pointwise
convolutions take split (a depthwise-separable block: no collective but the pointwise one's all-reduce), and one
whose split would be gathered again (before a LayerNorm over the channels, before another region's column split)
is kept whole by choice, the plan saying why. Each checked exact by autotp.check at tp=2 and 4."""

from __future__ import annotations

import pytest
import torch

from tests import conv_models


_checked, _split = conv_models.checked_plan, conv_models.split_kinds


@pytest.mark.parametrize("tp", [2, 4])
def test_a_depthwise_convolution_on_the_residual_stream_opens_a_region(tp):
    torch.manual_seed(0)
    plan = _checked(conv_models.SeparableStack().train(), tp, (torch.randn(2, 16, 6, 6),))
    split = _split(plan)
    # each depthwise convolution reads its channels of the whole stream; its pointwise convolution closes the split
    for block in ("1", "2"):
        assert split[f"dw{block}.weight"] == "colwise" and split[f"pw{block}.weight"] == "rowwise"
    assert split["dw1.bias"] == split["bn1.weight"] == split["bn2.bias"] == "colwise"
    assert "pw1.bias" not in split  # added once, after the all-reduce
    assert not plan.by_choice


@pytest.mark.parametrize("tp", [2, 4])
def test_depthwise_convolutions_whose_split_would_be_gathered_are_kept_whole_by_choice(tp):
    torch.manual_seed(0)
    plan = _checked(conv_models.ConvNeXtBlock(), tp, (torch.randn(2, 16, 6, 6),))
    split = _split(plan)
    assert split["pw1.weight"] == split["dw1.weight"] == "colwise" and split["pw2.weight"] == "rowwise"
    assert split["up.weight"] == "colwise" and split["down.weight"] == "rowwise"
    # dw2 reads pw2's all-reduced output and feeds pw3, which the next region splits by its output channels;
    # dwconv feeds the LayerNorm over the channels: both would be all-gathered again, so both run whole
    assert "dw2.weight" not in split and "dwconv.weight" not in split
    assert {"dw2", "dwconv"} <= set(plan.by_choice)
    notes = {n.split(" kept whole by choice: ")[0]: n for n in plan.notes if " kept whole by choice: " in n}
    assert "layer_norm" in notes["dwconv"] and "another region splits by its output features" in notes["dw2"]
