"""Capture fallbacks for branches on tensor values (autotp/capture/fallbacks/guards.py), checked with ``autotp.check``."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from autotp.capture import capture
from autotp.checker import check
from autotp.errors import CaptureError

ASSERT = torch.ops.aten._assert_scalar.default


def _seeded(*shape) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(0))


def test_a_mask_inspected_by_value_is_captured_with_a_runtime_check():
    """``nn.Transformer`` compares ``tgt_mask`` with a causal mask (``_detect_is_causal_mask``): the branch the
    example takes is captured, and an input that would take the other raises instead of computing it wrong."""
    torch.manual_seed(0)
    model = nn.Transformer(32, 4, 1, 1, 64, dropout=0.0, batch_first=True)
    tgt = 8
    inputs = {"src": _seeded(2, 16, 32), "tgt": _seeded(2, tgt, 32),
              "tgt_mask": nn.Transformer.generate_square_subsequent_mask(tgt)}
    captured = capture(model, inputs, training=True)
    assert any("_detect_is_causal_mask" in line for line in captured.assumptions), captured.assumptions
    modules = []
    report = check(model, 2, inputs, modules_hook=lambda ranks, comms: modules.extend(ranks))
    assert report.exact, report.mismatch
    assert len(modules) == 2 and all(any(n.target is ASSERT for n in m.graph.nodes) for m in modules)
    with pytest.raises(RuntimeError, match="assertion"):
        captured.module(inputs["src"], inputs["tgt"], torch.zeros(tgt, tgt))


def _wav2vec2(**settings):
    transformers = pytest.importorskip("transformers")
    from devtools.tiny import tiny_config

    torch.manual_seed(0)
    return transformers.Wav2Vec2ForCTC(tiny_config("wav2vec2", settings))


AUDIO = {"input_values": _seeded(2, 4000)}


def test_wav2vec2_with_default_settings_names_the_setting_to_change():
    """SpecAugment draws its masks from numpy in training mode: refused, naming the setting."""
    with pytest.raises(CaptureError, match="^set mask_time_prob=0 "):
        check(_wav2vec2(), 2, AUDIO)


def test_layer_drop_is_refused_with_its_setting():
    """LayerDrop decides on ``torch.rand([]) < layerdrop``: a branch on a random draw is refused."""
    with pytest.raises(CaptureError, match="layerdrop=0"):
        capture(_wav2vec2(mask_time_prob=0.0), AUDIO, training=True)


def test_wav2vec2_with_its_label_check_is_exact():
    """The CTC head checks ``labels.max() >= vocab_size``: captured as the example takes it, checked at run time.
    Its loss (``_ctc_loss``, sized by the longest label, a value) and its output lengths (an integer floor
    division) need the fallback capture's fake kernel and meta kernels."""
    model = _wav2vec2(mask_time_prob=0.0, layerdrop=0.0)
    inputs = AUDIO | {"labels": torch.randint(1, model.config.vocab_size, (2, 5), generator=torch.Generator().manual_seed(1))}
    assert any("labels" in line for line in capture(model, inputs, training=True).assumptions)
    report = check(model, 2, inputs)
    assert report.exact, report.mismatch


class _LayerDropStack(nn.Module):
    """LayerDrop as m2m_100 writes it: the rate copied from the config under another name at construction."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.layerdrop = config.encoder_layerdrop
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(2))

    def forward(self, x):
        for layer in self.layers:
            if self.training and self.layerdrop > 0.0:
                dropout_probability = torch.rand([])
                if dropout_probability < self.layerdrop:
                    continue
            x = layer(x)
        return x


def test_a_layer_drop_rate_copied_from_the_config_is_named_by_its_config_field():
    """``self.layerdrop = config.encoder_layerdrop``: the refusal names the config's field, the one to set."""
    from types import SimpleNamespace

    from autotp.errors import TrainingSettingError

    model = _LayerDropStack(SimpleNamespace(encoder_layerdrop=0.1, dropout=0.1))
    with pytest.raises(TrainingSettingError, match=r"^set encoder_layerdrop=0 ") as refused:
        capture(model, (_seeded(2, 16),), training=True)
    assert refused.value.settings == {"encoder_layerdrop": 0}


class _EncoderWithHead(nn.Module):
    """A head over an encoder built from a config nested in the model's (a CTC head's ``encoder_config``)."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.encoder = _LayerDropStack(config.encoder_config)
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        return self.head(self.encoder(x))


def test_a_setting_of_a_nested_config_is_named_by_its_path_and_the_zoo_rebuilds_with_it():
    """The encoder reads its own config, nested in the model's: the refusal names the setting by its path from the
    model's config, and the zoo's re-check sets it there."""
    transformers = pytest.importorskip("transformers")
    from autotp.errors import TrainingSettingError
    from devtools.zoo import _with_settings

    config = transformers.PretrainedConfig()
    config.encoder_config = transformers.PretrainedConfig(encoder_layerdrop=0.1)
    model = _EncoderWithHead(config)
    with pytest.raises(TrainingSettingError, match=r"^set encoder_config.encoder_layerdrop=0 ") as refused:
        capture(model, (_seeded(2, 16),), training=True)
    assert refused.value.settings == {"encoder_config.encoder_layerdrop": 0}
    rebuilt = _with_settings(model, refused.value.settings)
    assert rebuilt.encoder.layerdrop == 0 and model.encoder.layerdrop == 0.1
    capture(rebuilt, (_seeded(2, 16),), training=True)


class _MaskedSoftmax(torch.autograd.Function):
    """SEW-D's ``XSoftmax``: a softmax whose masked entries are zeroed in place on its own output, with a
    hand-written backward that never reads what autograd would have saved."""

    @staticmethod
    def forward(ctx, x, mask):
        out = torch.softmax(x.masked_fill(mask, torch.finfo(x.dtype).min), -1)
        out.masked_fill_(mask, 0)
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx, grad):
        (out,) = ctx.saved_tensors
        return out * (grad - (grad * out).sum(-1, keepdim=True)), None


class _ScoresModel(nn.Module):
    def __init__(self):
        super().__init__()
        # no key bias: its true gradient is zero (a constant per query row under a softmax), only rounding
        self.q, self.k = nn.Linear(16, 16), nn.Linear(16, 16, bias=False)

    def forward(self, x):
        scores = self.q(x) @ self.k(x).transpose(-1, -2)
        mask = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool).triu(1)
        return _MaskedSoftmax.apply(scores, mask) @ x


def test_a_function_writing_in_place_to_what_autograd_saves_is_captured_out_of_place():
    torch.manual_seed(0)
    model = _ScoresModel()
    captured = capture(model, (_seeded(2, 6, 16),), training=True)
    targets = {str(n.target) for n in captured.module.graph.nodes}
    assert "aten.masked_fill.Scalar" in targets and "aten.masked_fill_.Scalar" not in targets


def _fake_ctc_loss():
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    with FakeTensorMode(shape_env=ShapeEnv()):
        log_probs = torch.randn(20, 2, 6).log_softmax(-1)
        lengths = torch.full((2,), 20, dtype=torch.long)
        return torch.ops.aten._ctc_loss.Tensor(log_probs, torch.ones(6, dtype=torch.long), lengths,
                                               torch.full((2,), 3, dtype=torch.long), 0, False)


def test_the_fallback_captures_kernels_are_in_place_only_while_it_runs():
    """The CTC loss's fake kernel and the floor division's meta kernel serve the fallback capture only: torch's
    own registrations are back after it."""
    from torch._decomp import decomposition_table

    from autotp.capture.fallbacks.fake_kernels import fake_kernels_registered
    from autotp.torch_private import decompositions_off

    with fake_kernels_registered(), decompositions_off():
        loss, forward_variables = _fake_ctc_loss()
        assert loss.shape == (2,) and forward_variables.shape[:2] == (2, 20)
        assert torch.ops.aten.div.Tensor_mode not in decomposition_table
    assert torch.ops.aten.div.Tensor_mode in decomposition_table
    with pytest.raises(Exception, match="_ctc_loss"):
        _fake_ctc_loss()


class _UnguardedLayerDrop(nn.Module):
    """LayerDrop as OmniASR writes it: a draw every step in training, compared with the rate even when it is 0."""

    def __init__(self, layerdrop: float):
        super().__init__()
        self.layerdrop = layerdrop
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(2))

    def forward(self, x):
        for layer in self.layers:
            to_drop = False
            if self.training:
                dropout_probability = torch.rand([])
                if dropout_probability < self.layerdrop:
                    to_drop = True
            if not to_drop:
                x = layer(x)
        return x


def test_a_branch_no_draw_can_change_is_captured_and_exact():
    """``torch.rand([]) < 0`` is False whatever is drawn: the branch the example takes is every step's."""
    torch.manual_seed(0)
    report = check(_UnguardedLayerDrop(0.0), 2, (_seeded(2, 16),))
    assert report.exact, report.mismatch


def test_a_branch_a_draw_decides_is_still_refused():
    with pytest.raises(CaptureError, match="depends on random numbers"):
        capture(_UnguardedLayerDrop(0.1), (_seeded(2, 16),), training=True)
