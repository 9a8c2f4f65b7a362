"""A value the forward computes again from the same inputs is traced once (``capture.computed_once``): DeBERTa's
per-layer scales and relative-position indices. Shared only where it cannot change a result: no random draw, no
value that needs a gradient, and a forward that writes into a shared value is traced again without sharing."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import autotp
from autotp.capture import capture
from autotp.capture.computed_once import _deterministic_op, computed_once
from tests import models
from tests.models import RelativeLM


def _count(graph, *targets) -> int:
    return sum(n.target in targets for n in graph.nodes)


def _ids():
    return (torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1)),)


def test_scales_and_indices_each_block_recomputes_are_traced_once_and_the_split_model_is_exact():
    torch.manual_seed(0)
    model = RelativeLM()
    graph = capture(model, _ids(), training=True).graph
    assert _count(graph, torch.ops.aten.sqrt.default) == 1
    assert _count(graph, torch.ops.aten.clamp.default) == 1
    assert _count(graph, torch.ops.aten.embedding.default) == 4  # the token embedding and each block's own bias
    report = autotp.check(model, 2, _ids())
    assert report.exact, report
    assert report.plan.placements["blocks.0.qkv.weight"].is_split


class _WritesIntoARepeat(nn.Module):
    """Makes the same zeros twice and writes into the first: the second must stay zeros."""

    def __init__(self, how: str):
        super().__init__()
        self.how, self.lin = how, nn.Linear(8, 8)

    def forward(self, x):
        first, second = torch.zeros(x.shape[-1]), torch.zeros(x.shape[-1])
        if self.how == "add_":
            first.add_(1)
        elif self.how == "setitem":
            first[:4] = 1
        elif self.how == "iadd":
            first += 1
        else:  # through a view, which shares its base's version counter
            first.view(2, 4)[0].fill_(1)
        return self.lin(x) * (first + 1) + second


@pytest.mark.parametrize("how", ["add_", "setitem", "iadd", "view"])
def test_a_write_into_a_shared_value_is_traced_again_as_the_model_runs_it(how):
    torch.manual_seed(0)
    model, x = _WritesIntoARepeat(how), torch.randn(3, 8)
    captured = capture(model, (x,), training=True)
    assert _count(captured.graph, torch.ops.aten.zeros.default) == 2
    assert torch.equal(models.first_tensor(captured.module(x)), model(x))


class _Draws(nn.Module):
    """Two draws from one no-grad tensor, and a weight scaled twice (which needs a gradient)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        mask = torch.ones_like(x)
        noise = torch.rand_like(mask) + torch.rand_like(mask)
        kept = F.dropout(mask, 0.5, self.training) * F.dropout(mask, 0.5, self.training)
        return F.linear(x * noise * kept, self.lin.weight * 2, self.lin.bias) + F.linear(x, self.lin.weight * 2)


def test_random_draws_and_values_that_need_a_gradient_are_never_shared():
    graph = capture(_Draws(), (torch.randn(3, 8),), training=True).graph
    assert _count(graph, torch.ops.aten.rand_like.default) == 2
    assert _count(graph, torch.ops.aten.dropout.default) == 2
    assert _count(graph, torch.ops.aten.mul.Tensor) == 5  # two weight scalings, the products of draws and input
    assert _count(graph, torch.ops.aten.ones_like.default) == 1


@pytest.mark.parametrize("func", [torch.add, torch.Tensor.__add__, torch.Tensor.__rtruediv__, torch.clamp,
                                  torch.sqrt, torch.Tensor.expand, torch.Tensor.float, torch.arange, torch.tensor])
def test_deterministic_functional_ops_may_be_shared(func):
    assert _deterministic_op(func)


@pytest.mark.parametrize("func", [F.dropout, torch.rand_like, torch.bernoulli, torch.randperm, F.gumbel_softmax,
                                  torch.empty, torch.Tensor.new_empty, torch.Tensor.add_, torch.Tensor.__iadd__,
                                  torch.Tensor.__setitem__, F.rrelu, torch.normal, F.fractional_max_pool2d,
                                  F.fractional_max_pool3d, F.dropout1d, torch.poisson])
def test_draws_writes_and_uninitialised_tensors_never_are(func):
    assert not _deterministic_op(func)


def test_nothing_is_shared_once_a_tensor_s_data_is_taken():
    """``.data`` shares no version counter, so a write through it would go unseen (the mode run eagerly: torch.export
    cannot trace ``.data`` of a traced tensor at all)."""
    with computed_once() as once:
        scale = torch.ones(())
        before = scale * 2
        again = scale * 2
        scale.data.add_(1)
        after = scale * 2
    assert again is before and after.item() == 4 and not once.shared_value_written()
