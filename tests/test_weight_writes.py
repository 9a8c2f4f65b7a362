"""Forwards that write a parameter's ``.data`` in place (Gemma 3n's AltUp): captured as no-grad writes, exact on
every rank's shard (the gloo run is ``tests/test_structures.py``'s ClampedCoefficientsLM), the user's model untouched."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import autotp
from autotp.capture import capture
from autotp.errors import CaptureError
from tests import models
from tests.structures_workers import ClampedCoefficientsLM


def _ids():
    return (models.tokens(2, 16, 1),)


def test_a_weight_clamped_through_data_is_split_exact_and_the_user_s_model_is_untouched():
    torch.manual_seed(0)
    model = ClampedCoefficientsLM()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert model.up.weight.abs().max() > 2 * model.CLIP  # the clamp changes the weights the step reads
    report = autotp.check(model, 2, _ids())
    assert report.exact, report
    assert report.plan.placements["up.weight"].is_split
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_the_graph_writes_the_parameter_without_gradient_and_its_readers_read_the_parameter():
    torch.manual_seed(0)
    graph = capture(ClampedCoefficientsLM(), _ids(), training=True).graph
    (write,) = [n for n in graph.nodes if n.target is torch.ops.aten.clamp_.default]
    weight = write.args[0]
    assert weight.op == "get_attr" and weight.target.endswith("up.weight") and not write.users
    grad_off = [n for n in graph.nodes if n.target is torch._C._set_grad_enabled]
    order = list(graph.nodes)
    assert grad_off[0].args == (False,) and order.index(grad_off[0]) < order.index(write) < order.index(grad_off[1])
    (linear,) = [n for n in weight.users if n.target is torch.ops.aten.linear.default]
    assert order.index(write) < order.index(linear)
    assert not any(n.target is torch.ops.aten.clamp_.default for n in capture(
        ClampedCoefficientsLM().eval(), _ids(), training=False).graph.nodes)  # eval: the model does not write


class _DataRead(nn.Module):
    """Reads a weight's ``.data`` (no gradient through it) to scale its output."""

    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(16, 64), nn.Linear(64, 16)

    def forward(self, x):
        scale = self.up.weight.data.abs().mean()
        return self.down(torch.relu(self.up(x))) / scale


def test_a_data_read_is_a_detached_read():
    torch.manual_seed(0)
    report = autotp.check(_DataRead(), 2, torch.randn(2, 5, 16))
    assert report.exact, report


class _DataAssigned(nn.Module):
    def __init__(self, rows: int = 16):
        super().__init__()
        self.up, self.down, self.rows = nn.Linear(16, 64), nn.Linear(64, 16), rows

    def forward(self, x):
        self.up.weight.data = self.up.weight.data[:self.rows].clamp(-0.05, 0.05)
        return self.down(torch.relu(self.up(x)))


def test_a_data_assignment_is_a_no_grad_copy_and_one_of_another_size_is_refused():
    torch.manual_seed(0)
    model = _DataAssigned(rows=64)
    before = model.up.weight.detach().clone()
    assert before.abs().max() > 0.1
    report = autotp.check(model, 2, torch.randn(2, 5, 16))
    assert report.exact, report
    assert torch.equal(model.up.weight, before)
    with pytest.raises(CaptureError, match="another size"):
        capture(_DataAssigned(rows=8), torch.randn(2, 5, 16), training=True)
