"""Tiny captured graphs for the per-module tests: a function or module captured as autotp captures models."""

from __future__ import annotations

import torch
from torch import fx, nn

from autotp.capture import Captured, capture


class _Fn(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *args):
        return self.fn(*args)


def captured(fn_or_module, *inputs: torch.Tensor) -> Captured:
    """``fn_or_module`` (a function of tensors, or an nn.Module) captured on ``inputs``."""
    module = fn_or_module if isinstance(fn_or_module, nn.Module) else _Fn(fn_or_module)
    return capture(module, inputs)


def node(cap: Captured, target, nth: int = 0) -> fx.Node:
    """The ``nth`` node calling ``target`` (an ATen overload)."""
    found = [n for n in cap.graph.nodes if n.target is target]
    assert len(found) > nth, f"no node {nth} calling {target} in\n{cap.graph}"
    return found[nth]


class MLP(nn.Module):
    """Column then row projection (no biases, so the ranks' partial outputs sum to the output)."""

    def __init__(self, dim: int = 8, hidden: int = 16, bias: bool = False):
        super().__init__()
        self.up = nn.Linear(dim, hidden, bias=bias)
        self.down = nn.Linear(hidden, dim, bias=bias)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


class Heads(nn.Module):
    """A projection viewed as heads, attention over them, merged back and projected (a minimal attention)."""

    def __init__(self, dim: int = 16, heads: int = 4):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.out = nn.Linear(dim, dim, bias=False)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, t, d))
