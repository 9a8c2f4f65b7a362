"""Capturing with the speed-ups switched off (the ``capture_speedups`` option, ``AUTOTP_CAPTURE_SPEEDUPS``) gives
the same graph and plan, slower; two threads that capture at once each get the capture they would alone."""

from __future__ import annotations

import threading
import time

import pytest
import torch

import autotp
from autotp.capture import capture
from autotp.errors import InputError
from autotp.torch_private import CAPTURE_LOCK, kernel_tables
from bench.shape_kernels import signature
from tests import models


def _zoo(name: str):
    from devtools.zoo import entries

    (entry,) = entries({name})
    torch.manual_seed(0)
    model = entry.build()
    return model, entry.inputs(model)


@pytest.mark.parametrize("name", ["llama", "swin:image"])
def test_a_zoo_model_plans_the_same_without_speedups(name):
    """The plan (JSON, byte for byte) and the captured graph (node for node, metas included) are the same with the
    speed-ups off (option or environment variable) as with them on."""
    model, inputs = _zoo(name)
    fast = autotp.plan(model, 2, inputs)
    slow = autotp.plan(model, 2, inputs, capture_speedups=False)
    assert slow.to_json() == fast.to_json()
    assert "capture_speedups" not in fast.to_json()  # how the model was captured is not part of the plan
    assert autotp.Plan.from_json(slow.to_json()) == slow == fast
    assert signature(capture(model, inputs, speedups=False).module) == signature(capture(model, inputs).module)


def _speedups_seen(monkeypatch_env: str | None, monkeypatch, **kwargs) -> list[bool]:
    """Whether the shape-only kernels were in place each time the model's forward was traced or run."""
    if monkeypatch_env is None:
        monkeypatch.delenv("AUTOTP_CAPTURE_SPEEDUPS", raising=False)
    else:
        monkeypatch.setenv("AUTOTP_CAPTURE_SPEEDUPS", monkeypatch_env)
    seen = []
    model = models.build("gpt")
    model.register_forward_pre_hook(lambda *_: seen.append(bool(kernel_tables._TORCH_VIEW)))
    capture(model, models.tokens(2, 8, 0), **kwargs)
    return seen


def test_the_environment_variable_and_the_argument_switch_the_speedups(monkeypatch):
    assert any(_speedups_seen(None, monkeypatch))
    assert not any(_speedups_seen("0", monkeypatch))
    assert not any(_speedups_seen("off", monkeypatch))
    assert any(_speedups_seen("0", monkeypatch, speedups=True))  # the option wins over the variable
    assert not any(_speedups_seen(None, monkeypatch, speedups=False))
    with pytest.raises(InputError, match="AUTOTP_CAPTURE_SPEEDUPS"):
        _speedups_seen("maybe", monkeypatch)


def test_the_option_is_validated():
    with pytest.raises(InputError, match="capture_speedups"):
        autotp.Options(capture_speedups="no")


_RUNS: list[str] = []
"""The thread of each forward call of a ``_Slow`` (module-level: a capture restores a model's plain attributes as
copies)."""


class _Slow(torch.nn.Module):
    """A small model whose forward sleeps and logs which thread ran it; ``square`` applies a user's autograd
    Function (which the capture records in ``custom_functions``)."""

    def __init__(self, square: bool):
        super().__init__()
        self.linear, self.square = torch.nn.Linear(8, 8), square

    def forward(self, x):
        _RUNS.append(threading.current_thread().name)
        time.sleep(0.01)  # long enough for the other thread to run, if it could
        y = self.linear(x)
        return models.Square.apply(y) if self.square else y.relu()


def test_two_threads_capture_one_after_the_other_each_as_alone():
    """Two captures started together run one after the other (the forwards of one never between the other's), and
    each records only its own model's autograd Functions: the other's ``Function.apply`` replacement never sees
    them. Each graph is the one a capture alone makes."""
    made = {"a": _Slow(square=True), "b": _Slow(square=False)}
    x = torch.randn(2, 8)
    alone = {k: signature(capture(m, x, training=True).module) for k, m in made.items()}
    _RUNS.clear()
    out, errors = {}, []

    def run(name):
        try:
            out[name] = capture(made[name], x, training=True)
        except Exception as e:  # reported below, in the main thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=(k,), name=k) for k in made]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    switches = sum(a != b for a, b in zip(_RUNS, _RUNS[1:]))
    assert set(_RUNS) == {"a", "b"} and switches == 1, _RUNS
    assert out["a"].custom_functions == ("tests.models.Square",) and out["b"].custom_functions == ()
    assert {k: signature(c.module) for k, c in out.items()} == alone
    assert torch.autograd.Function.__dict__["apply"] is not None and not CAPTURE_LOCK._is_owned()
