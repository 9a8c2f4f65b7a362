"""Activation recompute per block: exact with dropout on (tp on gloo, the one-process checker, pipelines), and
fewer saved activations."""

from __future__ import annotations

import torch

import autotp
from autotp.capture import capture, example_inputs_of
from autotp.checker import build_ranks
from autotp.options import Options, Recompute
from autotp.planning import make_plan
from examples.gpt import build_gpt
from tests import models, recompute_workers
from tests.distributed import run_on_ranks


def test_tensor_parallel_recompute_with_dropout_is_exact():
    results = run_on_ranks(recompute_workers.tensor_parallel_dropout, 2)
    for name, result in results[0].items():
        assert result["blocks"] >= 4, (name, result)  # two layers: attention and MLP of each at least


def test_pipeline_recompute_with_dropout_is_exact():
    results = run_on_ranks(recompute_workers.pipeline_dropout, 2, ["1f1b", "zbv"])
    for schedule, result in results[0].items():
        assert result["blocks"] >= 2, (schedule, result)


def test_checker_finds_recompute_exact_with_dropout():
    torch.manual_seed(0)
    model = build_gpt(n_layer=2, dropout=0.2).train()
    report = autotp.check(model, tp=2, example_inputs=(models.tokens(2, 16, 1),), recompute="blocks")
    assert report.exact, report


def _saved_bytes(gm, x) -> int:
    total = 0

    def pack(t):
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        gm(x)
    return total


def test_recompute_keeps_fewer_activations():
    torch.manual_seed(0)
    model = build_gpt(n_layer=4, dropout=0.1).train()
    x = models.tokens(2, 32, 1)
    captured = capture(model, example_inputs_of(model, (x,)), training=True)
    plan = make_plan(captured, Options(tp=1))
    (kept,), _ = build_ranks(captured, plan)
    (recomputed,), _ = build_ranks(captured, plan, recompute=Recompute.BLOCKS)
    assert _saved_bytes(recomputed, x) < 0.7 * _saved_bytes(kept, x)


def test_recompute_is_a_validated_option():
    assert Options(recompute="blocks").recompute is Recompute.BLOCKS
    try:
        Options(recompute="layers")
    except autotp.InputError as e:
        assert "recompute must be one of ['none', 'blocks']" in str(e)
    else:
        raise AssertionError("recompute='layers' accepted")
