"""Forwards that write a parameter's ``.data`` in place (Gemma 3n's AltUp): captured as no-grad writes, exact on
every rank's shard (the gloo run is ``tests/test_structures.py``'s ClampedCoefficientsLM), the user's model untouched."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import autotp
from autotp.capture import capture
from autotp.errors import CaptureError, PlanError
from tests import models
from tests.distributed import run_on_ranks
from tests.workers import assert_trains_like
from tests.structures_workers import ClampedCoefficientsLM


def _ids():
    return (models.tokens(2, 16, 1),)


def test_a_weight_clamped_through_data_is_split_exact_and_the_user_s_model_is_untouched():
    torch.manual_seed(0)
    model = ClampedCoefficientsLM()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert model.up.weight.abs().max() > 2 * model.CLIP  # the clamp changes the weights the step reads
    report = autotp.check(model, 2, _ids())
    assert report.exact, report
    assert report.plan.placements["up.weight"].is_split
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_the_graph_writes_the_parameter_without_gradient_and_its_readers_read_the_parameter():
    torch.manual_seed(0)
    graph = capture(ClampedCoefficientsLM(), _ids(), training=True).graph
    (write,) = [n for n in graph.nodes if n.target is torch.ops.aten.clamp_.default]
    weight = write.args[0]
    assert weight.op == "get_attr" and weight.target.endswith("up.weight") and not write.users
    grad_off = [n for n in graph.nodes if n.target is torch._C._set_grad_enabled]
    order = list(graph.nodes)
    assert grad_off[0].args == (False,) and order.index(grad_off[0]) < order.index(write) < order.index(grad_off[1])
    (linear,) = [n for n in weight.users if n.target is torch.ops.aten.linear.default]
    assert order.index(write) < order.index(linear)
    assert not any(n.target is torch.ops.aten.clamp_.default for n in capture(
        ClampedCoefficientsLM().eval(), _ids(), training=False).graph.nodes)  # eval: the model does not write


class _DataRead(nn.Module):
    """Reads a weight's ``.data`` (no gradient through it) to scale its output."""

    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(16, 64), nn.Linear(64, 16)

    def forward(self, x):
        scale = self.up.weight.data.abs().mean()
        return self.down(torch.relu(self.up(x))) / scale


def test_a_data_read_is_a_detached_read():
    torch.manual_seed(0)
    report = autotp.check(_DataRead(), 2, torch.randn(2, 5, 16))
    assert report.exact, report


class _DataWrites(nn.Module):
    def __init__(self, write):
        super().__init__()
        self.up, self.down, self.write = nn.Linear(16, 64), nn.Linear(64, 16), write

    def forward(self, x):
        self.write(self.up.weight)
        return self.down(torch.relu(self.up(x)))


def _assign(weight):
    weight.data = weight.data.clamp(-0.05, 0.05)


def _assign_rows(weight):
    weight.data[:2] = 0  # once captured as a write through a detached slice: on a rank's shard, the wrong rows


def _assign_into_a_row(weight):
    weight.data[0][:] = 1


class _CastsItself(nn.Module):
    """``Module.to`` of a module already in that dtype in the forward (Switch Transformers' router): torch sets
    each parameter's ``.data`` to itself."""

    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(16, 64), nn.Linear(64, 16)

    def forward(self, x):
        self.up = self.up.to(torch.float32)
        return self.down(torch.relu(self.up(x)))


def test_a_parameter_s_data_set_to_itself_is_nothing():
    torch.manual_seed(0)
    report = autotp.check(_CastsItself(), 2, torch.randn(2, 5, 16))
    assert report.exact and report.plan.placements["up.weight"].is_split, report


@pytest.mark.parametrize("write, refused", [
    (lambda w: w.data.mul_(0.99), "with mul_"),  # repeated by a pipeline's microbatches, it would compound
    (lambda w: w.data.clamp_(-w.data.abs().mean(), 0.1), "with clamp_"),  # a bound that is a tensor
    (_assign, r"replaces a parameter's \.data \(p\.data = \.\.\.\)"),
    (lambda w: w.data[0].zero_(), r"into a part of a parameter's \.data \(zero_\)"),
    (_assign_rows, r"\.data with an indexed assignment \(p\.data\[\.\.\.\] = \.\.\.\)"),
    (_assign_into_a_row, r"into a part of a parameter's \.data \(an indexed assignment \(p\.data\[\.\.\.\] = \.\.\.\)\)"),
], ids=["mul_", "tensor-bound", "assigned", "part", "indexed", "indexed-part"])
def test_a_write_that_is_not_a_repeatable_whole_write_is_refused_naming_the_line(write, refused):
    model = _DataWrites(write)
    before = model.up.weight.detach().clone()
    with pytest.raises(CaptureError, match=refused + r" at test_weight_writes\.py:\d+"):
        capture(model, torch.randn(2, 5, 16), training=True)
    assert torch.equal(model.up.weight, before)


class _Block(nn.Module):
    def __init__(self, dim: int = 64):
        super().__init__()
        self.up, self.down = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)

    def forward(self, x):
        if self.training:
            self.up.weight.data.clamp_(-0.02, 0.02)  # in the block: written where it is read
        return x + self.down(torch.relu(self.up(x)))


class _PipelinedLM(nn.Module):
    """Four clamping blocks; the top-level forward also clamps the last block's ``down`` weight, which a
    two-stage pipeline holds in its second stage."""

    def __init__(self, dim: int = 64):
        super().__init__()
        self.embed, self.head = nn.Embedding(models.VOCAB, dim), nn.Linear(dim, models.VOCAB)
        self.blocks = nn.ModuleList(_Block(dim) for _ in range(4))

    def forward(self, ids):
        if self.training:
            self.blocks[3].down.weight.data.clamp_(-0.01, 0.01)
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _pipelined(rank: int, world: int) -> list:
    """Two AdamW steps of ``_PipelinedLM`` at pp=2 (1F1B, 4 microbatches: each stage writes once per microbatch)
    against the unsharded model: every loss and every parameter after."""
    torch.manual_seed(0)
    ref = _PipelinedLM()
    pm = autotp.parallelize(ref, tp=1, pp=world, example_inputs=_ids(), microbatches=4, schedule="1f1b")
    assert_trains_like(pm, ref, models.tokens(8, 12, seed=2), models.tokens(8, 12, seed=3))
    return [list(stage.modules) for stage in pm.plan.stages]


def test_a_pipeline_writes_each_weight_in_the_stage_that_reads_it_once_per_microbatch_exactly():
    stages = run_on_ranks(_pipelined, 2)[0]
    assert "blocks.3" in stages[1] and "blocks.3" not in stages[0]


def _data_parallel(rank: int, world: int, mode: str) -> None:
    """Two AdamW steps of ClampedCoefficientsLM on ``world`` replicas, each on its half of the batch, against one
    process on the whole batch: FSDP's forward reads all-gathered weights, and the stored shards must be written
    as the unsharded model's weights are."""
    torch.manual_seed(0)
    ref = ClampedCoefficientsLM()
    pm = autotp.parallelize(ref, tp=1, dp=world, dp_mode=mode, example_inputs=_ids())
    rows = slice(pm.dp_rank * 8 // world, (pm.dp_rank + 1) * 8 // world)
    assert_trains_like(pm, ref, models.tokens(8, 12, seed=2), models.tokens(8, 12, seed=3), rows)


@pytest.mark.parametrize("mode", ["fsdp", "replicate"])
def test_data_parallel_replicas_write_their_weights_as_the_model_does(mode):
    run_on_ranks(_data_parallel, 2, mode)


class _TiedAndClamped(_PipelinedLM):
    """The head reads the embedding's table (tied), and the forward clamps it: its readers sit in the first and
    the last pipeline stage, each of which holds a copy."""

    def __init__(self, dim: int = 64):
        super().__init__(dim)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        if self.training:
            self.embed.weight.data.clamp_(-0.5, 0.5)
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def test_a_weight_written_and_read_in_two_pipeline_stages_is_refused_naming_it():
    from autotp.options import Options
    from autotp.planning import make_plan
    from autotp.rewrite import build_graph, split_stages

    torch.manual_seed(0)
    captured = capture(_TiedAndClamped(), _ids(), training=True)
    plan = make_plan(captured, Options(tp=1, pp=2))
    with pytest.raises(PlanError, match=r"embed\.weight is written in place by the forward .* read in pipeline "
                                        r"stages \[0, 1\]"):
        split_stages(build_graph(captured, plan, 0, None), captured.analysis, plan, [0, 1])
