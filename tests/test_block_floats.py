"""Blocks that differ only in a float attribute (``capture.block_floats``): stamped with each block's own
constants, and captured in full wherever a block's float would decide something differently or reaches the
graph by a way the tracking does not see."""

from __future__ import annotations

import math

import pytest
import torch
from autotp.capture import capture
import copy

from autotp.capture.stamping.block_floats import Ambiguous, Constants, Log, Tracked
from autotp.capture.stamping.repeats import NotRepeated, capture_repeated, repeated_runs, stamp

from tests.test_repeats import _ops


class _Scaled(torch.nn.Module):
    """A block with a rate of its own, used as ``use`` says."""

    def __init__(self, rate: float, use: str):
        super().__init__()
        self.rate, self.use, self.lin = rate, use, torch.nn.Linear(8, 8)

    def forward(self, x):
        y = self.lin(x)
        if self.use == "keep":  # a drop path's scale, computed in Python as a drop path computes it
            return x + y / (1 - self.rate)
        if self.use == "dropout":  # the rate itself reaches the graph (EfficientNet's dropout rate per block)
            return x + torch.nn.functional.dropout(y, self.rate, self.training)
        if self.use == "branch":  # the rate decides the graph
            return x + (y.relu() if self.rate > 0.25 else y.tanh()) * self.rate
        if self.use == "math":  # the rate reaches the graph through math, out of the tracking's sight
            return x + y * math.sqrt(self.rate)
        if self.use == "steps":  # a step of the rate: the same in the captured blocks, another in the last
            return x + y * (self.rate // 0.25)
        if self.use == "lookup":  # a set lookup that misses in the captured blocks only
            return x + (y.relu() if self.rate in {0.3} else y.tanh())
        if self.use == "cached":  # a value the forward keeps on the module
            self.keep = 1 - self.rate
            return x + y / self.keep
        return x + y[..., :int(self.rate * 20)].sum(-1, keepdim=True)  # "size": the rate sets a slice's length


class _Stack(torch.nn.Module):
    def __init__(self, rates: list[float], use: str):
        super().__init__()
        self.blocks = torch.nn.ModuleList(_Scaled(r, use) for r in rates)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def _output(captured, x):
    out = captured.module(x)
    return out[0] if isinstance(out, tuple) else out


RISING = [0.0, 0.05, 0.1, 0.15, 0.2, 0.3]


def test_blocks_that_differ_in_a_rate_are_stamped_with_their_own_constants():
    model, x = _Stack(RISING, "keep"), torch.randn(2, 8)
    (run,) = repeated_runs(model)
    assert run.keys == ("1", "2", "3", "4", "5")  # the zero rate is a block of its own (``p == 0`` branches)
    full, made = capture(model, (x,)), stamp(model, (x,))
    assert _ops(made) == _ops(full)
    divisors = [n.args[1] for n in made.graph.nodes if n.target is torch.ops.aten.div.Tensor]
    assert divisors == [1 - r for r in RISING]
    assert torch.equal(_output(made, x), model(x))


def test_a_rate_read_as_it_is_is_stamped_too():
    model, x = _Stack(RISING, "dropout"), torch.randn(2, 8)
    full, made = capture(model, (x,)), stamp(model, (x,))
    assert _ops(made) == _ops(full)
    assert [n.args[1] for n in made.graph.nodes if n.target is torch.ops.aten.dropout.default] == RISING


@pytest.mark.parametrize("rates, use", [
    ([0.1, 0.15, 0.2, 0.3], "branch"),  # the last block takes the other branch
    ([0.1, 0.15, 0.2, 0.3], "math"),  # the constants differ with nothing recorded to explain them
    ([0.1, 0.15, 0.2, 0.3], "size"),  # int(rate * 20): 2, 3, 4, then 6 columns
    ([0.1, 0.1, 0.2, 0.3], "keep"),  # the captured blocks share a rate: a constant made from it looks shared
    ([0.1, 0.15, 0.2, 0.3], "steps"),  # rate // 0.25: 0, 0, 0, then 1
    ([0.1, 0.15, 0.2, 0.3], "lookup"),  # the last block takes the other branch
])
def test_a_rate_that_decides_or_escapes_the_record_falls_back_to_the_full_capture(rates, use):
    model, x = _Stack(rates, use), torch.randn(2, 8)
    assert repeated_runs(model)  # the signatures agree: only the tracking tells the blocks apart
    with pytest.raises(NotRepeated):
        stamp(model, (x,))
    made = capture_repeated(model, (x,))
    assert _ops(made) == _ops(capture(model, (x,)))
    assert torch.equal(_output(made, x), model(x))


def test_the_attributes_are_put_back_and_the_model_is_unchanged():
    model, x = _Stack(RISING, "keep"), torch.randn(2, 8)
    before = [vars(b).copy() for b in model.blocks]
    stamp(model, (x,))
    assert all(type(b.rate) is float for b in model.blocks)
    assert [vars(b) for b in model.blocks] == before


def test_a_value_the_forward_keeps_on_a_module_is_a_plain_float_afterwards():
    model, x = _Stack(RISING, "cached"), torch.randn(2, 8)
    made = stamp(model, (x,))
    assert all(type(b.keep) is float for b in model.blocks[:3])  # the captured blocks set it while tracked
    assert _ops(made) == _ops(capture(model, (x,)))
    copy.deepcopy(model)


class _Window(torch.nn.Module):
    """A plain or shifted block (as Swin's) with two rates of its own: a dropout's and a scale's."""

    def __init__(self, shifted: bool, rate: float, other: float):
        super().__init__()
        self.shifted, self.rate, self.other, self.lin = shifted, rate, other, torch.nn.Linear(8, 8)

    def forward(self, x):
        y = torch.nn.functional.dropout(self.lin(x), self.rate, self.training)
        return x + (y.roll(1, -1) if self.shifted else y) * (1 + self.other)


class _TwoRates(torch.nn.Module):
    def __init__(self, first: list[float], second: list[float]):
        super().__init__()
        self.blocks = torch.nn.ModuleList(_Window(i % 2 == 1, a, b) for i, (a, b) in enumerate(zip(first, second)))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def test_a_unit_of_two_blocks_with_two_rates_each_is_stamped_with_every_blocks_own():
    rates = [0.02 * (i + 1) for i in range(8)]
    model, x = _TwoRates(rates, [r / 2 for r in rates]), torch.randn(2, 8)
    (run,) = repeated_runs(model)
    assert run.period == 2 and run.keys == tuple(map(str, range(8)))
    made, full = stamp(model, (x,)), capture(model, (x,))
    assert _ops(made) == _ops(full)
    assert [n.args[1] for n in made.graph.nodes if n.target is torch.ops.aten.dropout.default] == rates


def test_rates_that_fit_the_captured_blocks_alike_but_part_later_are_not_stamped():
    # two rates equal in the first two blocks: either explains their dropouts, but not the same way later
    model, x = _TwoRates([0.1, 0.2, 0.3, 0.4], [0.1, 0.2, 0.25, 0.5]), torch.randn(2, 8)
    with pytest.raises(NotRepeated):
        stamp(model, (x,))
    assert _ops(capture_repeated(model, (x,))) == _ops(capture(model, (x,)))


def test_a_tracked_float_records_computations_and_decisions():
    log = Log()
    p = Tracked(0.1, lambda values: values["p"], log, 0)
    keep = 1 - p
    scale = 2.0 / keep
    assert isinstance(scale, Tracked) and scale.value == 2.0 / (1 - 0.1) and not log.decisions
    assert scale.of({"p": 0.5}) == 4.0
    constants = Constants(log, [{"p": 0.1}, {"p": 0.5}, {"p": 0.25}])
    assert constants.made_as(2.0 / 0.9, 4.0)({"p": 0.25}) == 2.0 / 0.75
    assert constants.made_as(2.0 / 0.9, 3.0) is None
    assert (p > 0.05) is True and int(p * 30) == 3
    assert log.decided_alike({"p": 0.12}) and not log.decided_alike({"p": 0.2})  # int(0.2 * 30) is 6
    assert Constants(log, [{"p": 1.0}, {"p": 0.5}]).made_as(2.0 / 0.9, 4.0) is None  # 2 / (1 - 1) fails
    shared = Constants(log, [{"p": 0.1}, {"p": 0.1}, {"p": 0.5}])
    with pytest.raises(Ambiguous):  # 0.9 in both captured units, but 0.5 in the third
        shared.made_as(0.9, 0.9)


def test_two_units_rates_compared_or_combined_decide_nothing_a_later_unit_can_repeat():
    log = Log()
    first, second = (Tracked(v, lambda values: values["p"], log, unit) for unit, v in enumerate((0.1, 0.2)))
    assert (first == second) is False  # a cache comparing two blocks' rates: a later unit would compare its own
    assert not log.decided_alike({"p": 0.3})
    made = first + second
    assert made.value == 0.1 + 0.2 and all(t is not made for t in log.derived)
