"""A dense convolution kept whole (a patch embedding) is named in the plan's notes, with why."""

from __future__ import annotations

import torch
from torch import nn

import autotp


class _Patches(nn.Module):
    """A patch-embedding convolution, then an MLP over the patches."""

    def __init__(self, dim=64):
        super().__init__()
        self.patch = nn.Conv2d(3, dim, 4, stride=4)
        self.up, self.down = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, images):
        x = self.patch(images).flatten(2).transpose(1, 2)
        return x + self.down(torch.relu(self.up(x)))


def test_a_patch_embedding_kept_whole_is_noted():
    torch.manual_seed(0)
    plan = autotp.plan(_Patches(), 2, (torch.randn(2, 3, 16, 16),))
    assert any(n.startswith("patch kept whole: a dense convolution") for n in plan.notes), plan.notes
    assert plan.placements["up.weight"].is_split
