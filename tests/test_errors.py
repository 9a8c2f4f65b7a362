"""Every bad input gets an autotp error that says what is wrong and what to do."""

import re
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import autotp
from examples.gpt import build_gpt
from examples.llama import build_llama
from tests import models

EXAMPLE = (models.tokens(2, 16, 0),)


def test_tp_not_dividing_heads_names_layer_size_and_valid_tp():
    model = build_gpt(n_embd=96, n_head=4)  # 96 features split by 3 fine, but 4 heads are not
    with pytest.raises(autotp.PlanError) as err:
        autotp.plan(model, tp=3, example_inputs=EXAMPLE)
    text = str(err.value)
    assert "'transformer.h.0.attn.c_attn'" in text and "tp=3" in text
    assert "size 4 (the attention heads)" in text
    assert "Valid tp values for this model: 1, 2, 4" in text


def test_tp_not_dividing_mlp_width():
    with pytest.raises(autotp.PlanError) as err:
        autotp.plan(build_llama(hidden_dim=90), tp=4, example_inputs=EXAMPLE)
    text = str(err.value)
    assert "gated_mlp at 'layers.0.feed_forward.w1, layers.0.feed_forward.w3'" in text
    assert "output features (90" in text and "Valid tp values for this model: 1, 2" in text


class _LeavesTorch(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x):
        scale = float(x.detach().numpy().sum())  # leaves torch for numpy: nothing can trace it
        return self.proj(x) * scale


def test_uncapturable_model_says_what_was_tried_where_and_what_to_do():
    with pytest.raises(autotp.CaptureError) as err:
        autotp.plan(_LeavesTorch(), tp=2, example_inputs=(torch.randn(2, 4),))
    text = str(err.value)
    assert "torch.export.export(strict=False)" in text
    assert ".numpy() is not supported" in text
    assert "test_errors.py" in text and "in forward" in text
    assert "Make the forward traceable" in text
    assert "Capturing the branches the example takes failed too" in text


@pytest.mark.parametrize("inputs, match", [
    ([1, 2], r"example_inputs\[0\] is a int"),
    ("ids", "must be a tensor or a non-empty tuple"),
    ((), "must be a tensor or a non-empty tuple"),
])
def test_inputs_of_the_wrong_type(inputs, match):
    with pytest.raises(autotp.InputError, match=match):
        autotp.plan(build_gpt(), tp=2, example_inputs=inputs)


def test_model_must_be_a_module():
    with pytest.raises(autotp.InputError, match="must be a torch.nn.Module"):
        autotp.plan(lambda x: x, tp=2, example_inputs=EXAMPLE)


@pytest.mark.parametrize("tp", [0, -1, 2.0, "2", True])
def test_tp_must_be_a_positive_int(tp):
    with pytest.raises(autotp.InputError, match="tp must be a positive integer"):
        autotp.plan(build_gpt(), tp=tp, example_inputs=EXAMPLE)


def test_parallelize_without_processes_says_how_to_launch():
    with pytest.raises(autotp.RuntimeSetupError, match="torchrun --nproc-per-node 2"):
        autotp.parallelize(build_gpt(), tp=2, example_inputs=EXAMPLE)


def test_plan_naming_unknown_parameters_is_refused():
    model = build_gpt()
    plan = autotp.plan(model, tp=1, example_inputs=EXAMPLE)
    bad = plan.replace(placements={**plan.placements, "no.such.weight": autotp.Placement("replicated")})
    with pytest.raises(autotp.PlanError, match="no.such.weight"):
        autotp.parallelize(model, tp=1, example_inputs=EXAMPLE, plan=bad)


def test_plan_for_another_tp_is_refused():
    model = build_gpt()
    plan = autotp.plan(model, tp=2, example_inputs=EXAMPLE)
    with pytest.raises(autotp.PlanError, match="made for tp=2"):
        autotp.parallelize(model, tp=1, example_inputs=EXAMPLE, plan=plan)


class _HeadsInBlocks(nn.Module):
    """Two heads of 16 per slot, two slots folded into the heads dim (JetMoE's queries per expert slot): the heads
    dim holds 2 parts of 2 heads, so tp=4 cannot split it."""

    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(64, 32), nn.Linear(32, 64)

    def forward(self, x):
        b, t, slots, _ = x.shape
        h = torch.softmax(self.up(x).view(b, t, slots * 2, 16), dim=-1)
        return self.down(h.view(b, t, slots, 32))


def test_a_size_checked_per_part_says_so():
    with pytest.raises(autotp.PlanError) as err:
        autotp.plan(_HeadsInBlocks(), tp=4, example_inputs=(torch.randn(2, 3, 2, 64),))
    text = str(err.value)
    assert "reshape to (?, 3, 4, 16) per part (it holds 2 parts side by side, each split alike)" in text, text
    assert "has size 2" in text and "Valid tp values for this model: 1, 2" in text, text


def _older_releases() -> list[str]:
    """Releases before the oldest tested one (two minors back, the one before it, an old major) and a version
    string that names no release."""
    from autotp.torch_version import MINIMUM_TORCH

    major, minor = MINIMUM_TORCH
    return [f"{major}.{minor - 2}.0+cu130", f"{major}.{minor - 1}.1", f"{major - 1}.13.1", "nightly"]


@pytest.mark.parametrize("version", _older_releases())
def test_an_older_torch_is_refused_naming_the_release_needed(version):
    from autotp.torch_version import MINIMUM_TORCH, require_supported_torch

    expected = rf"needs torch >= {MINIMUM_TORCH[0]}\.{MINIMUM_TORCH[1]}, found torch " + re.escape(version)
    with pytest.raises(autotp.errors.UnsupportedTorchError, match=expected):
        require_supported_torch(version)


def _tested_builds() -> list[str]:
    """Each tested release as torch's builds name it (CPU, CUDA, a nightly of the same minor): derived from
    ``TESTED_TORCH``, so that adding a release does not make these tests stale."""
    from autotp.torch_version import TESTED_TORCH

    first, last = TESTED_TORCH[0], TESTED_TORCH[-1]
    return [f"{first}+cpu", *(f"{v}+cu130" for v in TESTED_TORCH[1:]), f"{last.rsplit('.', 1)[0]}.0.dev20261101"]


def _later_releases() -> list[str]:
    """Releases after the newest tested one: the next minor, its nightly, the next major."""
    from autotp.torch_version import NEWEST_TESTED_TORCH

    major, minor = NEWEST_TESTED_TORCH
    return [f"{major}.{minor + 1}.0", f"{major}.{minor + 2}.0.dev20270101+cu130", f"{major + 1}.0.0"]


@pytest.mark.parametrize("version", _tested_builds())
def test_a_tested_torch_release_passes_without_a_warning(version):
    from autotp.torch_version import require_supported_torch

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        require_supported_torch(version)


@pytest.mark.parametrize("version", _later_releases())
def test_a_later_torch_warns_once_naming_the_tested_releases(version, monkeypatch):
    from autotp import torch_version

    monkeypatch.setattr(torch_version, "_WARNED", set())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # pytest's and Python's own once-per-place filters are not what is tested
        for _ in range(3):
            torch_version.require_supported_torch(version)
    assert [w.category for w in caught] == [autotp.UntestedTorchWarning], caught
    assert issubclass(autotp.UntestedTorchWarning, UserWarning)
    text = str(caught[0].message)
    assert f"tested with torch {torch_version.tested_range()}, found torch {version}" in text, text
    assert f"pip install torch=={torch_version.TESTED_TORCH[-1]}" in text, text


def test_the_tested_range_is_the_one_pyproject_states():
    """pyproject.toml names the tested releases beside the torch requirement; they must be the ones checked."""
    from autotp.torch_version import TESTED_TORCH

    text = (Path(__file__).resolve().parent.parent / "pyproject.toml").read_text()
    stated = re.search(r"tested with torch ([\d., ]+) and ([\d.]+) ", text)
    assert stated and (*stated[1].split(", "), stated[2]) == TESTED_TORCH, stated
