"""A projection split alone by its input features (a lone row, ``RegionKind.ROW``) whose input is made from a
parameter alone, a learnt position table expanded to the batch (Perceiver's positions projection): the table is
split with it, so nothing is sliced and no gradient gathered. Checked exact by autotp.check at tp=2 and 4."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import autotp


class ProjectedPositions(nn.Module):
    """A position table projected by a linear, concatenated to the normalised inputs' features (which a column
    split of the projection would have to slice), then a classifier."""

    def __init__(self, positions: int = 8, dim: int = 32, width: int = 16, classes: int = 10):
        super().__init__()
        self.table = nn.Parameter(torch.randn(positions, dim))
        self.norm, self.project, self.head = nn.LayerNorm(width), nn.Linear(dim, width), nn.Linear(2 * width, classes)

    def forward(self, x):
        positions = self.project(self.table.expand(x.shape[0], -1, -1))
        return self.head(torch.cat([self.norm(x), positions], -1))


@pytest.mark.parametrize("tp", [2, 4])
def test_a_lone_row_over_a_position_table_splits_the_table(tp):
    torch.manual_seed(0)
    report = autotp.check(ProjectedPositions(), tp, (torch.randn(2, 8, 16),))
    assert report.exact, report.mismatch
    split = {name: p.kind.value for name, p in report.plan.placements.items() if p.is_split}
    assert split["project.weight"] == "rowwise" and split["table"] == "colwise"
    assert any(n.startswith("project split alone by its input features (its input, made from table alone")
               for n in report.plan.notes), report.plan.notes
