"""Windowed vision models (the Swin family). Which input sizes a capture keeps dynamic: the batch and the sequence,
not an image's height and width (windowed models made torch.export reason for minutes about symbolic sizes padded,
rolled and split into windows); a caller's time limit ends the capture instead of starting another attempt; and
their attention, plain or cosine (Swin V2: normalized queries and keys, a learned scale and a bias per head), is
split by heads and exact."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import autotp
from autotp.capture import capture
from autotp.capture.core.dynamic import dynamic_dims, dynamic_shapes
from autotp.errors import CaptureError
from autotp.passes.graph import sizes
from autotp.planning.plan import RegionKind


class _Windowed(nn.Module):
    """Swin's structure in small: patches, padded to a multiple of the window, shifted (roll), split into windows,
    multi-head attention inside each window, windows merged back, then an MLP."""

    def __init__(self, dim=32, heads=4, window=4, shift=2, cosine=False):
        super().__init__()
        self.cosine = cosine
        # Swin V2's cosine attention: a learned temperature per head, a bias per head from a small MLP
        self.scale = nn.Parameter(torch.rand(heads, 1, 1) + 1)
        self.bias = nn.Sequential(nn.Linear(2, 16), nn.ReLU(), nn.Linear(16, heads))
        self.register_buffer("offsets", torch.linspace(-1, 1, window ** 4 * 2).view(window ** 2, window ** 2, 2))
        self.patch = nn.Conv2d(3, dim, 2, stride=2)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.up, self.down = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)
        self.heads, self.window, self.shift = heads, window, shift

    def forward(self, images):
        x = self.patch(images).permute(0, 2, 3, 1)  # [B, H, W, C]
        b, h, w, c = x.shape
        pad_h, pad_w = (self.window - h % self.window) % self.window, (self.window - w % self.window) % self.window
        x = nn.functional.pad(x, (0, 0, 0, pad_w, 0, pad_h))
        x = torch.roll(x, (-self.shift, -self.shift), (1, 2))
        hh, ww, k = x.shape[1] // self.window, x.shape[2] // self.window, self.window
        windows = x.view(b, hh, k, ww, k, c).transpose(2, 3).reshape(-1, k * k, c)
        q, kk, v = self.qkv(windows).view(windows.shape[0], k * k, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        if self.cosine:
            scores = nn.functional.normalize(q, dim=-1) @ nn.functional.normalize(kk, dim=-1).transpose(-2, -1)
            bias = self.bias(self.offsets).permute(2, 0, 1)  # [heads, tokens, tokens]
            q = (scores * self.scale.exp() + bias).softmax(-1)
            att = (q @ v).transpose(1, 2).reshape(windows.shape)
        else:
            att = nn.functional.scaled_dot_product_attention(q, kk, v).transpose(1, 2).reshape(windows.shape)
        x = windows + self.proj(att)
        x = x.view(b, hh, ww, k, k, c).transpose(2, 3).reshape(b, hh * k, ww * k, c)
        x = torch.roll(x, (self.shift, self.shift), (1, 2))[:, :h, :w]
        return x + self.down(torch.relu(self.up(x)))


def test_an_image_keeps_its_batch_dynamic_and_its_height_and_width_fixed():
    torch.manual_seed(0)
    cap = capture(_Windowed(), (torch.randn(2, 3, 16, 16),))
    (images,) = cap.graph.find_nodes(op="placeholder")
    batch, *rest = sizes(images)
    assert cap.dim_names.get(str(batch)) == "B" and [int(s) for s in rest] == [3, 16, 16]
    # the work torch.export does grows with the symbols it reasons about: the batch is the graph's only one
    symbols = {s for n in cap.graph.nodes if "val" in n.meta and isinstance(n.meta["val"], torch.Tensor)
               for size in sizes(n) for s in getattr(size, "free_symbols", ())}
    assert symbols == {batch}


@pytest.mark.parametrize("cosine", [False, True], ids=["plain", "cosine"])
def test_windowed_attention_is_split_by_heads_and_exact(cosine):
    torch.manual_seed(0)
    report = autotp.check(_Windowed(cosine=cosine), 2, (torch.randn(2, 3, 16, 16),))
    assert report.exact, report.mismatch
    attention = [r for r in report.plan.regions if r.kind == RegionKind.ATTENTION]
    columns = ("qkv", "bias.2") if cosine else ("qkv",)  # the bias MLP's last layer makes one bias per head
    assert [(r.columns, r.rows) for r in attention] == [(columns, ("proj",))], report.plan.regions
    assert report.plan.placements["scale"].is_split == cosine


def test_a_float_mask_stays_as_dynamic_as_the_token_ids_it_masks():
    ids, mask, images = torch.zeros(2, 16, dtype=torch.long), torch.zeros(2, 1, 16, 16), torch.zeros(2, 3, 32, 32)
    assert dynamic_dims(ids, frozenset({16})) == (0, 1)
    assert dynamic_dims(mask, frozenset({16})) == (0, 2, 3)
    assert dynamic_dims(images, frozenset({16})) == (0,)
    assert [set(spec) for spec in dynamic_shapes((ids, mask, images))[0]] == [{0, 1}, {0, 2, 3}, {0}]


def test_a_time_limit_ends_the_capture_without_another_attempt():
    class Slow(nn.Module):
        calls = 0

        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            Slow.calls += 1
            raise TimeoutError("took more than 1 s")  # what a caller's alarm raises in the middle of an export

    with pytest.raises(TimeoutError):
        capture(Slow(), (torch.randn(2, 4),))
    assert Slow.calls == 1


def test_a_capture_that_fails_still_tries_static_shapes():
    class Broken(nn.Module):
        calls = 0

        def forward(self, x):
            Broken.calls += 1
            raise ValueError("not traceable")

    with pytest.raises(CaptureError):
        capture(Broken(), (torch.randn(2, 4),))
    assert Broken.calls >= 2  # dynamic, then static (then the branch-taking fallback)
