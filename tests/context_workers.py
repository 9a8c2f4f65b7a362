"""Per-rank bodies of the context-parallelism tests on gloo: each rank computes its own chunks of every sequence,
and outputs, losses, gradients and parameters after AdamW steps equal the unsharded model's."""

from __future__ import annotations

import torch
from torch.testing import assert_close

import autotp
from tests import models
from tests.full_context_models import OddLM, hf_model
from tests.workers import ADAM, STEPS


def build(name: str) -> torch.nn.Module:
    """A small model of ``name``: ``odd`` (hand-written, a causal-mask buffer and a position table), or one of
    ``full_context_models.hf_model``'s Hugging Face decoders."""
    torch.manual_seed(0)
    return OddLM() if name == "odd" else hf_model(name)


def _logits(out) -> torch.Tensor:
    return models.first_tensor(out)


def _grads(pm) -> dict[str, torch.Tensor]:
    """Every parameter's gradient under its original name (a cp rank holds every parameter whole)."""
    out = {}
    for module in pm.rank_modules():
        for name, param in pm._names.params(module).items():
            if param.grad is not None:
                out[name] = param.grad
    return out


def train_against_unsharded(rank: int, world: int, name: str, seq: int = 16) -> dict:
    """cp=world: eval outputs, then STEPS AdamW steps of cross-entropy (the loss, every gradient, every parameter
    afterwards) equal the unsharded model's; returns the largest errors."""
    ref = build(name)
    x, y = models.tokens(2, seq, 1), models.tokens(2, seq, 2)
    pm = autotp.parallelize(ref, cp=world, tp=1, example_inputs=x)
    pm.eval(), ref.eval()
    with torch.no_grad():
        got, want = _logits(pm(x)), _logits(ref(x))
    assert_close(got, want, rtol=1e-5, atol=1e-6)
    errors = {"output": float((got - want).abs().max()), "loss": 0.0, "grad": 0.0}
    pm.train(), ref.train()
    opt, ref_opt = torch.optim.AdamW(pm.parameters(), **ADAM), torch.optim.AdamW(ref.parameters(), **ADAM)
    for _ in range(STEPS):
        loss = pm.step(x, target=y, loss_fn=models.loss_fn)
        ref_loss = models.loss_fn(ref(x), y)
        ref_loss.backward()
        assert_close(loss, ref_loss.detach(), rtol=1e-5, atol=1e-6)
        errors["loss"] = max(errors["loss"], float((loss - ref_loss.detach()).abs()))
        grads = _grads(pm)
        for key, p in ref.named_parameters():
            g = grads.get(key)
            assert g is not None, f"{name}: no gradient for {key}"
            assert_close(g, p.grad, rtol=1e-4, atol=1e-6, msg=lambda m: f"{name} grad {key}: {m}")
            errors["grad"] = max(errors["grad"], float((g - p.grad).abs().max()))
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
    full = pm.full_state_dict()
    for key, want in ref.state_dict().items():
        assert_close(full[key], want, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name} {key}: {m}")
    return errors
