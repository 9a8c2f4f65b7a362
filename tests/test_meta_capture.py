"""Models built without weights: ``empty_weights()`` allocates no parameter, and such a model (real buffers, meta
parameters) captures even where a parameter-derived value meets a buffer (a causal mask kept in a buffer)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

import autotp
from autotp.runtime.meta_init import empty_weights
from tests import models


class Experts(nn.Module):
    """Weights far larger than any machine's memory: allocating them fails, so building them must not."""

    def __init__(self):
        super().__init__()
        self.experts = nn.Parameter(torch.empty(256, 2 ** 16, 2 ** 16))  # 4 TiB of float32
        self.proj = nn.Linear(2 ** 20, 2 ** 20)  # 4 TiB
        self.register_buffer("scale", torch.empty(4))  # made empty, filled after it was registered
        self.scale.fill_(2.0)
        self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(0, 8, 2).float() / 8), persistent=False)


def test_empty_weights_never_allocates_parameters_and_keeps_buffers():
    with empty_weights():
        model = Experts()
    assert model.experts.is_meta and model.proj.weight.is_meta and model.proj.bias.is_meta
    assert torch.equal(model.scale, torch.full((4,), 2.0))
    assert torch.allclose(model.inv_freq, 1.0 / 10000 ** (torch.arange(0, 8, 2).float() / 8))
    assert torch.empty(2).device.type == "cpu"  # the context is gone


class FilledEarly(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("mask", torch.empty(4).fill_(1.0))


def test_a_buffer_filled_before_registration_is_refused_by_name():
    with pytest.raises(autotp.InputError, match=r"buffer FilledEarly.mask was made with torch.empty and filled"):
        with empty_weights():
            FilledEarly()


def test_a_meta_model_with_a_causal_mask_buffer_captures_and_computes_exactly(tmp_path):
    """RawGPT masks scores with ``~causal[:t, :t]``, a real buffer, against meta parameters."""
    real = models.build("raw_gpt")
    save_file({k: v.contiguous() for k, v in real.state_dict().items()}, tmp_path / "w.safetensors")
    with empty_weights():
        torch.manual_seed(0)
        meta = models.RawGPT(2)
    assert meta.blocks[0].w_qkv.is_meta and not meta.causal.is_meta
    x = models.tokens(2, 16, 3)
    plan = autotp.plan(meta, tp=2, example_inputs=(x,))
    assert plan.placements["blocks.0.w_qkv"].is_split
    pm = autotp.parallelize(meta, tp=1, example_inputs=(x,), checkpoint=tmp_path / "w.safetensors", quiet=True)
    torch.testing.assert_close(pm(x), real(x), rtol=0, atol=1e-6)
    assert not meta.causal.is_meta  # the model's buffer was put back


class FilledWeights(nn.Module):
    """Weights made with values (``randn * std``, ``ones``) too large for any host, and a large filled buffer."""

    def __init__(self, derived_buffer: bool = False):
        super().__init__()
        self.experts = nn.Parameter(torch.randn(256, 2 ** 16, 2 ** 16) * 0.02)  # 4 TiB
        self.norm = nn.Parameter(torch.ones(2 ** 28))  # 1 GiB
        self.register_buffer("table", torch.full((2 ** 27,), 3.0))  # large, made by one call: remade real
        if derived_buffer:
            self.register_buffer("mask", torch.tril(torch.ones(2 ** 14, 2 ** 14)))


def test_empty_weights_never_allocates_large_filled_weights_and_remakes_large_buffers():
    with empty_weights():
        model = FilledWeights()
    assert model.experts.is_meta and model.norm.is_meta
    assert not model.table.is_meta and model.table.shape == (2 ** 27,) and float(model.table[-1]) == 3.0


def test_a_buffer_computed_from_a_large_meta_tensor_is_refused_by_name():
    with pytest.raises(autotp.InputError, match=r"buffer FilledWeights.mask \(16384, 16384\) is on meta"):
        with empty_weights():
            FilledWeights(derived_buffer=True)
