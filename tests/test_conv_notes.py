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


class _StandardisedConv(nn.Conv2d):
    """A weight-standardised convolution (BiT's, timm's ``StdConv2d``): each output channel's weights normalised
    over its own elements before it convolves."""

    def forward(self, x):
        weight = nn.functional.batch_norm(self.weight.reshape(1, self.out_channels, -1), None, None, training=True,
                                          momentum=0.0, eps=1e-6).reshape_as(self.weight)
        return nn.functional.conv2d(x, weight, self.bias, self.stride, self.padding)


class _StandardisedBlock(nn.Module):
    def __init__(self, dim=64):
        super().__init__()
        self.a, self.b = _StandardisedConv(dim, 2 * dim, 3, padding=1), _StandardisedConv(2 * dim, dim, 1)

    def forward(self, x):
        return x + self.b(torch.relu(self.a(x)))


def test_convolutions_of_computed_weights_kept_whole_are_noted_naming_the_parameter_and_exact():
    torch.manual_seed(0)
    report = autotp.check(_StandardisedBlock(), 2, torch.randn(2, 64, 6, 6))
    assert report.exact, report
    for name in "ab":
        assert any(n.startswith(f"{name} kept whole: a dense convolution") and f"computed from {name}.weight" in n
                   for n in report.plan.notes), report.plan.notes
