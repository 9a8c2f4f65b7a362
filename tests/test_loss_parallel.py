"""Loss parallel: the cross-entropy of vocabulary-split logits is computed on the shards (Megatron's
vocab-parallel cross-entropy), in the graph (a model's own loss) and in ``pm.step`` (the default loss)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import autotp
from autotp.passes.placement import chunk_span
from autotp.passes.steps import Operator
from autotp.rewrite.vocab_parallel import vocab_parallel_cross_entropy
from tests import models
from tests.distributed import on_threads, run_on_ranks
from tests.inputs_workers import hf_llama, padded_batch
from tests.loss_workers import captured_user_loss, loss_parallel_on_ranks


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("shape", [(12, 16), (16,), (3, 16, 5), (12, 17), (3, 17, 5)])  # 17: cut unevenly
@pytest.mark.parametrize("reduction", [0, 1, 2])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_vocab_parallel_cross_entropy_equals_torchs(tp, shape, reduction, smoothing):
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(shape, generator=gen, dtype=torch.float64) * 4).requires_grad_()
    classes = 1 if len(shape) > 1 else 0
    target_shape = shape[:1] + shape[2:] if len(shape) > 1 else ()
    target = torch.randint(0, shape[classes], target_shape, generator=gen)
    ignore = 3  # a real class, ignored where the target names it
    if target.dim():
        target.view(-1)[::4] = ignore
    weights = torch.randn(torch.nn.functional.cross_entropy(logits, target, reduction="none").shape,
                          generator=gen, dtype=torch.float64)
    mode = ["none", "mean", "sum"][reduction]
    want = torch.nn.functional.cross_entropy(logits, target, reduction=mode, ignore_index=ignore,
                                             label_smoothing=smoothing)
    (want * weights if reduction == 0 else want).sum().backward()

    def rank_loss(comm):
        span = chunk_span(shape[classes], tp, comm.rank)
        mine = logits.detach().narrow(classes, *span).clone().requires_grad_()
        loss = vocab_parallel_cross_entropy(mine, target, comm, reduction, ignore, label_smoothing=smoothing,
                                            classes=shape[classes])
        (loss * weights if reduction == 0 else loss).sum().backward()
        return loss.detach(), mine.grad

    results = on_threads(tp, rank_loss)
    for loss, _ in results:
        torch.testing.assert_close(loss, want.detach(), rtol=1e-12, atol=1e-12, equal_nan=True)
    torch.testing.assert_close(torch.cat([g for _, g in results], classes), logits.grad, rtol=1e-12, atol=1e-12, equal_nan=True)


def test_a_models_own_loss_is_planned_on_the_split_logits():
    batch = padded_batch("right")
    plan = autotp.plan(hf_llama(), tp=2, vocab="split", example_inputs=batch)
    by_operator = {c.operator: c for c in plan.collectives}
    assert by_operator[Operator.CROSS_ENTROPY].shape[-1] == "3"  # three statistics per target
    (logits_gather,) = [c for c in plan.collectives if c.operator is Operator.GATHER]
    assert not logits_gather.in_step  # forward() gathers the logits; a training step does not


class _WeightedLM(nn.Module):
    """A loss the vocab-parallel cross-entropy does not cover (class weights): the logits are gathered."""

    def __init__(self):
        super().__init__()
        self.embed, self.head = nn.Embedding(64, 32), nn.Linear(32, 64)
        self.register_buffer("weights", torch.linspace(0.5, 1.5, 64))

    def forward(self, ids, labels):
        logits = self.head(self.embed(ids))
        return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), weight=self.weights)


def test_a_loss_outside_the_rule_gathers_the_logits_and_stays_exact():
    ids = models.tokens(2, 6, 0) % 64
    plan = autotp.plan(_WeightedLM(), tp=2, vocab="split", example_inputs=(ids, ids))
    assert Operator.CROSS_ENTROPY not in {c.operator for c in plan.collectives}
    assert any(c.operator is Operator.GATHER and c.in_step for c in plan.collectives)
    assert autotp.check(_WeightedLM(), tp=2, vocab="split", example_inputs=(ids, ids)).exact


def test_training_never_gathers_the_logits_on_two_ranks():
    results = run_on_ranks(loss_parallel_on_ranks, 2)
    for r in results:
        default, own = r["default"], r["own"]
        assert default["forward"] == [3 * 10 * models.VOCAB // 2]  # forward() gathers this rank's logits
        assert default["step"] == default["loss"] == [3 * 3 * 10]  # max, sum of exponentials, target logit
        assert own["step"] == [3 * 4 * 12]  # padded HF batch of 4 x 12 (labels shifted inside the model)
        assert max(default["error"], r["user"]["error"], own["error"]) < 1e-5
        assert default["overwritable"] == [True, True]  # the head's own output, read by nothing else
        alone, also_read = r["overwritten"]["False"], r["overwritten"]["True"]
        assert alone["overwritable"] == [True, True]  # train and eval graphs: the loss may overwrite the logits
        assert not any(also_read["overwritable"])  # tanh saves them for its backward
        assert max(alone["error"], also_read["error"]) < 1e-5


def test_the_vocab_parallel_loss_refuses_a_second_backward():
    """Its backward writes the gradient into the saved softmax (as Megatron's does): a second backward of the
    same graph is refused rather than computed from the overwritten softmax."""
    logits = torch.randn(4, 8, dtype=torch.float64)

    def twice(comm):
        mine = logits[:, comm.rank * 4:(comm.rank + 1) * 4].clone().requires_grad_()
        loss = vocab_parallel_cross_entropy(mine, torch.tensor([0, 5, 7, 2]), comm)
        loss.backward(retain_graph=True)
        with pytest.raises(autotp.InputError, match="backward ran twice"):
            loss.backward()
        return True

    assert on_threads(2, twice) == [True, True]


def test_the_default_loss_of_an_output_without_logits_names_the_way_out():
    from autotp.runtime.loss import default_loss

    with pytest.raises(autotp.InputError, match=r"output is a dict with no logits; pass loss_fn="):
        default_loss({"hidden": torch.zeros(2, 3)}, torch.zeros(2, dtype=torch.long))


def test_the_default_loss_names_a_target_that_does_not_fit_the_logits():
    from autotp.rewrite.collectives import OutputGather
    from autotp.runtime.loss import default_loss
    from autotp.runtime.outputs import SplitOutputs

    def mismatched(comm):
        logits = torch.randn(2, 3, 4)  # this rank's half of 8 classes
        split = SplitOutputs()
        split.recorded.append((logits, OutputGather(comm, 2, (8,))))
        with pytest.raises(autotp.InputError, match=r"logits of shape \(2, 3, 4\) need 6 targets, got a target of "
                                                    r"shape \(2, 4\)"):
            default_loss(logits, torch.zeros(2, 4, dtype=torch.long), split)
        return True

    assert on_threads(2, mismatched) == [True, True]


def test_a_user_loss_fn_is_captured_with_the_model_and_runs_on_the_split_logits():
    """``pm.step(x, target=y, loss_fn=f)``: ``f`` captured with the model, its cross-entropy vocab-parallel; the
    step moves at most 5% more than Megatron's minimum (gathering the logits for ``f`` moved 2.77x) and trains
    exactly."""
    results = run_on_ranks(captured_user_loss, 2)
    for rank in results:
        for name, r in rank.items():
            assert r["ratio"] <= 1.05, (name, r)
            assert r["error"] < 1e-5 and not r["warnings"], (name, r)


class _SmoothedLM(_WeightedLM):
    """Label smoothing, which the vocab-parallel cross-entropy covers with one statistic more per target."""

    def forward(self, ids, labels):
        logits = self.head(self.embed(ids))
        return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), label_smoothing=0.1)


def test_label_smoothing_runs_on_the_split_logits_exactly():
    ids = models.tokens(2, 6, 0) % 64
    plan = autotp.plan(_SmoothedLM(), tp=2, vocab="split", example_inputs=(ids, ids))
    (loss,) = [c for c in plan.collectives if c.operator is Operator.CROSS_ENTROPY]
    assert loss.shape[-1] == "4"  # max, sum of exponentials, target logit, sum of logits
    assert not any(c.operator is Operator.GATHER for c in plan.collectives)
    assert autotp.check(_SmoothedLM(), tp=2, vocab="split", example_inputs=(ids, ids)).exact
