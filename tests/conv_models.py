"""Tiny convolutional models of the structures autotp splits by channels: a ResNet bottleneck (batch norm in
training), a MobileNet-v2 inverted residual (a depthwise convolution in the middle), a Whisper-style conv1d front
end, and a token model made of them for the gloo structure tests."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


class Bottleneck(nn.Module):
    """ResNet's bottleneck: 1x1 down, 3x3, 1x1 up, each followed by batch norm, and the residual add."""

    def __init__(self, channels: int = 32, mid: int = 16):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(channels, mid, 1, bias=False), nn.BatchNorm2d(mid)
        self.conv2, self.bn2 = nn.Conv2d(mid, mid, 3, padding=1, bias=False), nn.BatchNorm2d(mid)
        self.conv3, self.bn3 = nn.Conv2d(mid, channels, 1, bias=False), nn.BatchNorm2d(channels)

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)))
        y = F.relu(self.bn2(self.conv2(y)))
        return F.relu(x + self.bn3(self.conv3(y)))


class InvertedResidual(nn.Module):
    """MobileNet-v2's block: a 1x1 expansion, a depthwise 3x3 (one group per channel), a 1x1 projection, with
    batch norms, ReLU6 (hardswish after the depthwise, as v3 has it) and the residual add; then average pooling
    and a classifier."""

    def __init__(self, channels: int = 16, expand: int = 4, classes: int = 10):
        super().__init__()
        wide = channels * expand
        self.expand, self.bn1 = nn.Conv2d(channels, wide, 1, bias=False), nn.BatchNorm2d(wide)
        self.depthwise = nn.Conv2d(wide, wide, 3, padding=1, groups=wide, bias=False)
        self.bn2 = nn.BatchNorm2d(wide)
        self.project, self.bn3 = nn.Conv2d(wide, channels, 1, bias=False), nn.BatchNorm2d(channels)
        self.head = nn.Linear(channels, classes)

    def forward(self, x):
        y = F.relu6(self.bn1(self.expand(x)))
        y = F.hardswish(self.bn2(self.depthwise(y)))  # MobileNet-v3's activation
        x = x + self.bn3(self.project(y))
        return self.head(F.adaptive_avg_pool2d(x, 1).flatten(1))


class SpeechFrontEnd(nn.Module):
    """Whisper's encoder front end: conv1d (k=3) and a strided conv1d (k=3, stride 2), each with a bias and GELU,
    then positions added and an MLP over the frames."""

    def __init__(self, mels: int = 8, dim: int = 32, frames: int = 16):
        super().__init__()
        self.conv1 = nn.Conv1d(mels, dim, 3, padding=1)
        self.conv2 = nn.Conv1d(dim, dim, 3, stride=2, padding=1)
        self.positions = nn.Parameter(torch.randn(frames // 2, dim) * 0.02)
        self.up, self.down = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, features):
        x = F.gelu(self.conv2(F.gelu(self.conv1(features)))).transpose(1, 2) + self.positions
        return x + self.down(F.gelu(self.up(x)))


class ConvLM(nn.Module):
    """Token ids through a conv1d pair, a bottleneck and an inverted residual over the positions (as a
    ``[B, D, T, 1]`` image), then a head: every channel structure trained on gloo ranks, at any length."""

    def __init__(self, vocab: int, dim: int = 32):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.conv1, self.conv2 = nn.Conv1d(dim, 2 * dim, 3, padding=1), nn.Conv1d(2 * dim, dim, 3, padding=1)
        self.block = Bottleneck(dim, dim // 2)
        wide = 2 * dim
        self.expand, self.bn = nn.Conv2d(dim, wide, 1), nn.BatchNorm2d(wide)
        self.depthwise = nn.Conv2d(wide, wide, (3, 1), padding=(1, 0), groups=wide)
        self.norm, self.project = nn.GroupNorm(4, wide), nn.Conv2d(wide, dim, 1)
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids):
        x = self.embed(ids).transpose(1, 2)
        x = x + self.conv2(F.gelu(self.conv1(x)))
        x = self.block(x.unsqueeze(-1))
        y = F.relu6(self.norm(self.depthwise(F.relu6(self.bn(self.expand(x))))))
        x = x + self.project(y)
        return self.head(x.squeeze(-1).transpose(1, 2))


class SeparableStack(nn.Module):
    """Two depthwise-separable residual blocks (depthwise 3x3, batch norm, ReLU, then a pointwise 1x1 added to the
    residual stream, the first block's sum normalised over every channel), pooling and a classifier: each depthwise
    convolution reads the whole residual stream, and no pointwise convolution closes a column split."""

    def __init__(self, channels: int = 16, classes: int = 10):
        super().__init__()
        self.dw1, self.bn1 = nn.Conv2d(channels, channels, 3, padding=1, groups=channels), nn.BatchNorm2d(channels)
        self.pw1 = nn.Conv2d(channels, channels, 1)
        self.dw2 = nn.Conv2d(channels, 2 * channels, 3, padding=1, groups=channels, bias=False)  # two per channel
        self.bn2, self.pw2 = nn.BatchNorm2d(2 * channels), nn.Conv2d(2 * channels, channels, 1, bias=False)
        self.head = nn.Linear(channels, classes)

    def forward(self, x):
        x = F.group_norm(x + self.pw1(F.relu(self.bn1(self.dw1(x)))), 1)  # one group: over every channel
        x = x + self.pw2(F.relu(self.bn2(self.dw2(x))))
        return self.head(F.adaptive_avg_pool2d(x, 1).flatten(1))


class ConvNeXtBlock(nn.Module):
    """ConvNeXt's block: a depthwise 7x7 on the residual stream, a LayerNorm over the channels (channels last),
    then an MLP of two linears added back; before it, MobileNet-v1's alternation of pointwise and depthwise
    convolutions: dw1 inside the split of pw1 and pw2, dw2 between pw2's and pw3's."""

    def __init__(self, channels: int = 16, classes: int = 10):
        super().__init__()
        self.pw1, self.dw1 = nn.Conv2d(channels, 2 * channels, 1), nn.Conv2d(2 * channels, 2 * channels, 3, padding=1,
                                                                              groups=2 * channels)
        self.pw2, self.dw2 = nn.Conv2d(2 * channels, channels, 1), nn.Conv2d(channels, channels, 3, padding=1,
                                                                              groups=channels)
        self.pw3, self.pw4 = nn.Conv2d(channels, 4 * channels, 1), nn.Conv2d(4 * channels, 2 * channels, 1)
        self.dwconv = nn.Conv2d(2 * channels, 2 * channels, 7, padding=3, groups=2 * channels)
        self.norm = nn.LayerNorm(2 * channels)
        self.up, self.down = nn.Linear(2 * channels, 8 * channels), nn.Linear(8 * channels, 2 * channels)
        self.head = nn.Linear(2 * channels, classes)

    def forward(self, x):
        x = self.pw2(F.relu(self.dw1(F.relu(self.pw1(x)))))
        x = self.pw4(F.relu(self.pw3(F.relu(self.dw2(x)))))
        y = self.norm(self.dwconv(x).permute(0, 2, 3, 1))
        x = x + self.down(F.gelu(self.up(y))).permute(0, 3, 1, 2)
        return self.head(x.mean((2, 3)))


class PositionalConvLM(nn.Module):
    """wav2vec2's positional convolution over token embeddings: a grouped conv1d (4 groups, an even kernel padded
    on both sides, its last frame trimmed) whose weight is normalised over its output and input channels for each
    kernel tap (``weight_norm(dim=2)``), its GELU added to the residual stream, then a layer norm, an MLP and a
    head. Its weight splits only by whole groups, the norm's sum of squares over the split channels all-reduced."""

    def __init__(self, vocab: int, dim: int = 32, groups: int = 4, kernel: int = 4):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        conv = nn.Conv1d(dim, dim, kernel, padding=kernel // 2, groups=groups)
        self.pos_conv = nn.utils.parametrizations.weight_norm(conv, name="weight", dim=2)
        self.norm = nn.LayerNorm(dim)
        self.up, self.down = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids):
        x = self.embed(ids)
        positions = F.gelu(self.pos_conv(x.transpose(1, 2))[:, :, :-1]).transpose(1, 2)
        x = self.norm(x + positions)
        return self.head(x + self.down(F.gelu(self.up(x))))


class HeadwiseConvAttention(nn.Module):
    """Nystromformer's value convolution: each head's values convolved along the positions by a depthwise Conv2d
    (one channel per head, a kernel of ``kernel`` positions by 1, padded to keep the length) and added to the
    head's output, between a column-split value projection and a row-split output one. Split by heads with tp =
    heads, every rank convolves one head: a dense convolution of one channel."""

    def __init__(self, vocab: int = 64, dim: int = 64, heads: int = 4, kernel: int = 65):
        super().__init__()
        self.heads = heads
        self.embed = nn.Embedding(vocab, dim)
        self.value, self.out = nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.conv = nn.Conv2d(heads, heads, (kernel, 1), padding=(kernel // 2, 0), groups=heads, bias=False)
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids):
        x = self.embed(ids)
        b, s, d = x.shape
        v = self.value(x).view(b, s, self.heads, d // self.heads).transpose(1, 2)  # B, H, S, D
        v = F.gelu(v) + self.conv(v)
        return self.head(x + self.out(v.transpose(1, 2).reshape(b, s, d)))


def checked_plan(model, tp, inputs):
    """The plan of ``model`` at ``tp``, after the one-process checker found it exact."""
    import autotp

    torch.manual_seed(0)
    report = autotp.check(model, tp, inputs)
    assert report.exact, report.mismatch
    return report.plan


def split_kinds(plan) -> dict[str, str]:
    """Each split parameter's kind (colwise, rowwise, ...)."""
    return {name: p.kind.value for name, p in plan.placements.items() if p.is_split}
