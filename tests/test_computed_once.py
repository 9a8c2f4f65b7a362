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
from autotp.capture.speedups.computed_once import _deterministic_op, computed_once
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


class _ProductUnderAutocast(nn.Module):
    """The same product of a buffer outside and inside CPU autocast: two values of two dtypes."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.register_buffer("table", torch.randn(8, 8))

    def forward(self, x):
        plain = self.table @ self.table
        with torch.autocast("cpu", dtype=torch.bfloat16):
            low = self.table @ self.table
        return self.lin(x) @ plain + (self.lin(x) @ low.float())


def test_a_call_under_cpu_autocast_is_not_the_call_outside_it():
    torch.manual_seed(0)
    model, x = _ProductUnderAutocast(), torch.randn(3, 8)
    with computed_once():
        plain, low = model.table @ model.table, None
        with torch.autocast("cpu", dtype=torch.bfloat16):
            low = model.table @ model.table
    assert plain.dtype == torch.float32 and low.dtype == torch.bfloat16
    captured = capture(model, (x,), training=True)  # autocast's region is a submodule of the graph
    assert torch.equal(models.first_tensor(captured.module(x)), model(x))


def test_a_result_that_came_to_need_a_gradient_is_not_handed_out_again():
    with computed_once():
        first = torch.zeros(3)
        first.requires_grad_()  # bumps no version
        second = torch.zeros(3)
    assert second is not first and not second.requires_grad


def test_an_integer_and_a_float_of_one_value_are_other_calls():
    with computed_once():
        scale = torch.ones(3, dtype=torch.int64)
        by_int, by_float, by_bool = scale * 2, scale * 2.0, scale * True
    assert by_int.dtype == torch.int64 and by_float.dtype == torch.float32 and by_bool.dtype == torch.int64
    assert by_bool is not by_int
