"""Structures a column split cannot keep exact (issue 25's negatives), checked at tp=2 in one process
(``autotp.check``): the column split is refused and each projection is then split alone, by its input features
(its input sliced, its output all-reduced), which is exact."""

from __future__ import annotations

import pytest
import torch.nn.functional as F
from torch import nn

from autotp.passes.placement import PlacementKind
from tests.test_structures_unit import B, D, T, _check, _model, _x


class SortedFeatures(nn.Module):
    """A sort across the projection's features: no rank can sort its part alone."""

    def __init__(self, inner=32):
        super().__init__()
        self.up = nn.Linear(D, inner, bias=False)
        self.down = nn.Linear(inner, D, bias=False)

    def forward(self, x):
        return self.down(F.gelu(self.up(x).sort(dim=-1).values))


class LayerNormedFeatures(nn.Module):
    """A layer_norm over the projection's whole width, then a plain projection (no row split follows)."""

    def __init__(self, inner=32):
        super().__init__()
        self.up = nn.Linear(D, inner, bias=False)
        self.norm = nn.LayerNorm(inner)
        self.head = nn.Linear(inner, D, bias=False)

    def forward(self, x):
        return self.head(F.layer_norm(self.up(x), self.norm.normalized_shape, self.norm.weight, self.norm.bias))


@pytest.mark.parametrize("cls, op", [(SortedFeatures, "sort"), (LayerNormedFeatures, "layer_norm")])
def test_unsplittable_structure_is_not_column_split(cls, op):
    report = _check(_model(cls), _x(B, T, D))
    assert not any(p.kind is PlacementKind.COLWISE for p in report.plan.placements.values()), report.plan
    assert {r.kind.value for r in report.plan.regions} == {"row"}, report.plan.regions
    assert report.plan.placements["up.weight"].kind is PlacementKind.ROWWISE
