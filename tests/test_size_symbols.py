"""Sizes of collectives whose shapes hold size symbols other than the first input's B and T (a second input's
length, as an encoder-decoder's decoder has): priced by the layout search at the example's values, named in a
``PlanError`` when no value is given, never a raw TypeError."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import autotp
from autotp.errors import PlanError
from autotp.passes.steps import CollectiveOp, Direction, Operator
from autotp.planning.plan import Collective
from autotp.tools.report import collective_bytes

HIDDEN = 32


class TwoLengths(nn.Module):
    """An encoder over ``ids`` (B x T) and a decoder over ``targets`` (B x S), each with its own MLP: the decoder
    MLP's all-reduce sends a B x S x hidden tensor, whose S the capture names neither B nor T."""

    def __init__(self, vocab: int = 64):
        super().__init__()
        self.embed = nn.Embedding(vocab, HIDDEN)
        self.enc_up, self.enc_down = nn.Linear(HIDDEN, 2 * HIDDEN), nn.Linear(2 * HIDDEN, HIDDEN)
        self.dec_up, self.dec_down = nn.Linear(HIDDEN, 2 * HIDDEN), nn.Linear(2 * HIDDEN, HIDDEN)
        self.head = nn.Linear(HIDDEN, vocab)

    def forward(self, ids, targets):
        memory = self.enc_down(torch.relu(self.enc_up(self.embed(ids)))).mean(1, keepdim=True)
        x = self.embed(targets) + memory
        return self.head(self.dec_down(torch.relu(self.dec_up(x))))


def _example():
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, 64, (4, 8), generator=g), torch.randint(0, 64, (4, 6), generator=g)


def test_a_size_symbol_without_a_value_is_named_in_a_plan_error():
    c = Collective(CollectiveOp.ALL_REDUCE, Direction.FORWARD, Operator.G, "dec_down", ("B", "s7", "32"))
    with pytest.raises(PlanError, match="s7"):
        c.nbytes(2, 8)
    assert c.nbytes(2, 8, {"s7": 5}) == 2 * 5 * 32 * 4
    assert collective_bytes(c, 2, 8) is None  # the plan table prints "?" for it


def test_the_layout_search_prices_a_second_inputs_length():
    plan = autotp.plan(TwoLengths(), example_inputs=_example(), world_size=4, machine="cpu")
    assert plan.layouts, "the search ranked no layout"
    split = autotp.plan(TwoLengths(), 2, example_inputs=_example())
    shapes = [c.shape for c in split.collectives]
    other = {s for shape in shapes for dim in shape for s in dim.replace("*", " ").split() if s.startswith("s")}
    assert other, f"no collective of the tp=2 plan has the decoder's length in its shape: {shapes}"
