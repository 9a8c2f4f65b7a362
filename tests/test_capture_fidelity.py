"""A captured graph that is not the model's function is refused at capture (autotp/capture/core/replay.py,
autotp/capture/core/hidden_gradients.py): never planned, never silently wrong."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import autotp
from autotp.capture import capture
from autotp.errors import CaptureError
from tests.models import Square


class _MaskedWhenTraced(nn.Module):
    """Attention whose mask exists only when traced, as transformers skips an all-ones mask when run eagerly and
    builds it under export: with an attention that is not causal by itself, eager and graph differ."""

    def __init__(self, d=32, heads=4):
        super().__init__()
        self.heads, self.qkv, self.out = heads, nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril() if torch.compiler.is_exporting() else None
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=False)
        return self.out(y.transpose(1, 2).reshape(b, t, d))


def test_a_forward_that_branches_on_being_traced_is_refused_not_checked_wrong():
    torch.manual_seed(0)
    x = torch.randn(2, 8, 32)
    with pytest.raises(CaptureError, match="another branch when traced"):
        autotp.check(_MaskedWhenTraced(), 2, (x,))
    with pytest.raises(CaptureError, match="another branch when traced"):
        autotp.plan(_MaskedWhenTraced(), 2, (x,))


def test_a_model_on_meta_is_not_replayed():
    with torch.device("meta"):
        model = _MaskedWhenTraced()
    assert capture(model, (torch.randn(2, 8, 32, device="meta"),)).graph is not None


class _Reversible(torch.autograd.Function):
    """A reversible coupling ``y2 = x2 + f(x1)`` run without gradients, its gradient given by its own backward
    (which recomputes ``f``): the structure of Reformer's reversible layers."""

    @staticmethod
    def forward(ctx, x, f):
        x1, x2 = x.chunk(2, dim=-1)
        with torch.no_grad():
            y2 = x2 + f(x1)
        ctx.f = f
        ctx.save_for_backward(x1)
        return torch.cat([x1, y2], dim=-1)

    @staticmethod
    def backward(ctx, grad):
        (x1,) = ctx.saved_tensors
        g1, g2 = grad.chunk(2, dim=-1)
        with torch.enable_grad():
            x1 = x1.detach().requires_grad_()
            torch.autograd.backward(ctx.f(x1), g2)
        return torch.cat([g1 + x1.grad, g2], dim=-1), None


class _ReversibleNet(nn.Module):
    def __init__(self, d=32):
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(d // 2, 2 * d), nn.ReLU(), nn.Linear(2 * d, d // 2))
        self.head = nn.Linear(d, d)

    def forward(self, x):
        return self.head(_Reversible.apply(x, self.inner))


def test_layers_whose_gradient_only_a_custom_backward_gives_are_refused_for_training_with_their_names():
    torch.manual_seed(0)
    model, x = _ReversibleNet(), torch.randn(2, 8, 32)
    with pytest.raises(CaptureError, match=r"no gradient to \d+ parameters.*inner\.0.*_Reversible.*eval mode"):
        autotp.plan(model.train(), 2, (x,))
    plan = autotp.plan(model.eval(), 2, (x,))  # inference has no backward to miss
    assert plan.tp == 2


class _KeepsItsState(nn.Module):
    """A recurrent layer that keeps its last state as a plain attribute (RecurrentGemma's ``recurrent_states``),
    through a custom Function, so that capture runs it once more with gradients to compare them."""

    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(16, 32), nn.Linear(32, 16)
        self.state = torch.zeros(32)

    def forward(self, x):
        h = Square.apply(self.up(x))
        self.state = h[-1, -1]
        return self.down(h)


def test_a_state_the_forward_keeps_is_as_it_was_after_capture_and_the_checker_copies_the_model():
    """The captures' own runs of the forward left it holding the autograd graph (a non-leaf tensor), which no
    deepcopy takes: the checker crashed on RecurrentGemma."""
    torch.manual_seed(0)
    model = _KeepsItsState()
    kept = model.state
    assert autotp.check(model, tp=2, example_inputs=(torch.randn(2, 4, 16),)).exact
    assert model.state is kept


def test_a_custom_function_whose_forward_autograd_can_differentiate_is_still_captured():
    class Scale(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w):
            ctx.save_for_backward(x, w)
            return x * w

        @staticmethod
        def backward(ctx, grad):
            x, w = ctx.saved_tensors
            return grad * w, (grad * x).sum(0)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.up, self.w, self.down = nn.Linear(16, 64), nn.Parameter(torch.randn(64)), nn.Linear(64, 16)

        def forward(self, x):
            return self.down(Scale.apply(self.up(x), self.w))

    torch.manual_seed(0)
    assert capture(Net(), (torch.randn(4, 16),), training=True).custom_functions


class _ApproximateBackward(torch.autograd.Function):
    """A forward whose own backward is not its derivative (an approximation, as YOSO's expectation backward)."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return torch.tanh(x)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return grad * (1 - x * x).clamp(min=0)  # a Taylor approximation of 1 - tanh(x)^2


class _ApproximateNet(nn.Module):
    def __init__(self, d=32):
        super().__init__()
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        return self.down(_ApproximateBackward.apply(self.up(x)))


def test_a_custom_backward_that_is_not_the_forwards_derivative_is_refused_for_training():
    torch.manual_seed(0)
    model, x = _ApproximateNet(), torch.randn(2, 8, 32)
    with pytest.raises(CaptureError, match=r"_ApproximateBackward whose backward is not the derivative.*up\.weight"):
        autotp.plan(model.train(), 2, (x,))
    assert all(p.grad is None for p in model.parameters())  # the check leaves no gradients behind
    assert autotp.plan(model.eval(), 2, (x,)).tp == 2  # inference has no backward to differ
