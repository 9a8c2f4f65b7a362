"""Activation recompute per block: exact with dropout on (tp on gloo, the one-process checker, pipelines), and
fewer saved activations."""

from __future__ import annotations

import pytest
import torch

import autotp
from autotp.capture import capture, example_inputs_of
from autotp.checker import build_ranks
from autotp.options import Options, Recompute
from autotp.planning import make_plan
from autotp.planning.recompute_cost import RecomputeCost, plan_recompute_cost
from autotp.rewrite.recompute import Recomputed
from autotp.rewrite.streams import RankStream
from bench.memory import SavedActivations
from examples.gpt import build_gpt
from tests import models, recompute_workers
from tests.distributed import run_each_on_ranks


@pytest.fixture(scope="module")
def on_ranks() -> dict:
    """The gloo runs of this file, in one spawn of 2 ranks: rank 0's results."""
    return run_each_on_ranks(2, {"tp": (recompute_workers.tensor_parallel_dropout,),
                                 "pp": (recompute_workers.pipeline_dropout, ["1f1b", "zbv"]),
                                 "dp": (recompute_workers.data_parallel,),
                                 "moe": (recompute_workers.pipeline_moe,)})[0]


def test_tensor_parallel_recompute_with_dropout_is_exact(on_ranks):
    for name, result in on_ranks["tp"].items():
        assert result["blocks"] >= 4, (name, result)  # two layers: attention and MLP of each at least


def test_pipeline_recompute_with_dropout_is_exact(on_ranks):
    assert sorted(on_ranks["pp"]) == ["1f1b", "zbv"]
    for schedule, result in on_ranks["pp"].items():
        assert result["blocks"] >= 2, (schedule, result)


def test_pipeline_recompute_of_a_mixture_of_experts_is_exact(on_ranks):
    # The router's index buffer is made in one recomputed block and written in place in the next; the worker
    # asserts the losses and every parameter equal to the run without recompute.
    losses = on_ranks["moe"]
    assert len(losses) > 1 and all(loss == loss for loss in losses), losses


def test_data_parallel_recompute_is_exact(on_ranks):
    assert sorted(on_ranks["dp"]) == ["fsdp", "replicate"]


def test_checker_finds_recompute_exact_with_dropout():
    torch.manual_seed(0)
    model = build_gpt(n_layer=2, dropout=0.2).train()
    report = autotp.check(model, tp=2, example_inputs=(models.tokens(2, 16, 1),), recompute="blocks")
    assert report.exact, report



class _SeesTheGenerator(torch.nn.Module):
    """Records the process-wide generator's state each time it runs (a leaf of the traced block)."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def forward(self, x):
        self.seen.append(torch.get_rng_state())
        return x * 2


class _LeafTracer(torch.fx.Tracer):
    def is_leaf_module(self, m, name):
        return isinstance(m, _SeesTheGenerator) or super().is_leaf_module(m, name)


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.sees = _SeesTheGenerator()

    def forward(self, x):
        return self.sees(x).sin()


def test_a_recomputed_block_with_a_stream_leaves_the_process_generator_alone():
    """With a rank stream the stream replays the masks, so the recompute must not set torch's process-wide
    generator (checkpoint's own restore of it is unlocked, and races the stream's swaps when the checker runs
    ranks as threads). The block's recompute sees the generator as it stands, not as it stood in forward."""
    block = _Block()
    traced = torch.fx.GraphModule(block, _LeafTracer().trace(block))
    x = torch.randn(4, requires_grad=True)
    torch.manual_seed(1)
    out = Recomputed(traced, RankStream(0))(x)
    torch.manual_seed(2)
    now = torch.get_rng_state()
    out.sum().backward()
    forward, recompute = block.sees.seen[-2:]
    assert not torch.equal(forward, now) and torch.equal(recompute, now)
    assert torch.equal(x.grad, 2 * torch.cos(2 * x.detach()))


def _saved_bytes(gm, x) -> int:
    """Bytes of the storages autograd keeps for backward in one forward, parameters excluded."""
    saved = SavedActivations(list(gm.parameters()))
    with saved:
        gm(x)
    return saved.bytes


def test_recompute_keeps_fewer_activations_as_the_cost_model_predicts():
    torch.manual_seed(0)
    model = build_gpt(n_layer=4, n_embd=128, n_head=4, vocab_size=1024, dropout=0.1).train()
    x = models.tokens(4, 64, 1)
    captured = capture(model, example_inputs_of(model, (x,)), training=True)
    plan = make_plan(captured, Options(tp=1))
    (kept,), _ = build_ranks(captured, plan)
    (recomputed,), _ = build_ranks(captured, plan, recompute=Recompute.BLOCKS)
    before, after = _saved_bytes(kept, x), _saved_bytes(recomputed, x)
    assert after < 0.2 * before, (before, after)
    predicted = plan_recompute_cost(captured, plan)
    assert abs(predicted.saved_bytes - (before - after)) < 0.05 * (before - after), (predicted, before, after)
    assert 0 < predicted.extra_flops < plan.stages[0].flops if plan.stages else predicted.extra_flops > 0
    assert plan_recompute_cost(captured, plan, Recompute.NONE) == RecomputeCost(0.0, 0.0)


def test_recompute_is_a_validated_option():
    assert Options(recompute="blocks").recompute is Recompute.BLOCKS
    try:
        Options(recompute="layers")
    except autotp.InputError as e:
        assert "recompute must be one of ['none', 'blocks']" in str(e)
    else:
        raise AssertionError("recompute='layers' accepted")
    try:
        Options(tp=2, recompute="blocks", compile=True)
    except autotp.InputError as e:
        assert "with compile=True is not verified" in str(e)
    else:
        raise AssertionError("recompute with compile accepted")
