"""Per-rank bodies of the loss-parallel tests on gloo: a training step computes its cross-entropy on the
vocabulary-split logits (Megatron's vocab-parallel loss) and never gathers them, exactly."""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
from torch.testing import assert_close
from torch.distributed.tensor.debug import CommDebugMode

import autotp
from bench.comm import count_calls, megatron_minimum
from bench.config import ModelShape
from examples.gpt import build_gpt
from tests import models
from tests.inputs_workers import hf_llama, padded_batch
from tests.workers import ADAM, STEPS


class GatherSizes:
    """Records the number of elements each rank contributes to every all-gather of values (floating point) while
    active; the integer all-gather each call makes to check that the ranks hold one batch (shapes and
    fingerprints, ``runtime.batch_agreement``) is not a gather of the model's values and is left out."""

    def __init__(self):
        self.sizes: list[int] = []
        self._original = dist.all_gather

    def __enter__(self):
        def recording(parts, x, *args, **kwargs):
            if x.is_floating_point():
                self.sizes.append(x.numel())
            return self._original(parts, x, *args, **kwargs)
        dist.all_gather = recording
        return self

    def __exit__(self, *exc):
        dist.all_gather = self._original


def _train(pm, ref, run_pm, ref_loss) -> float:
    """STEPS AdamW steps of both; every loss equal; the largest parameter error afterwards."""
    opt, ref_opt = torch.optim.AdamW(pm.parameters(), **ADAM), torch.optim.AdamW(ref.parameters(), **ADAM)
    for _ in range(STEPS):
        loss, want = run_pm(), ref_loss()
        want.backward()
        assert_close(loss, want.detach(), rtol=1e-5, atol=1e-6)
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
    full, worst = pm.full_state_dict(), 0.0
    for key, value in ref.state_dict().items():
        assert_close(full[key], value, rtol=1e-5, atol=1e-5, msg=lambda m: f"{key} after AdamW: {m}")
        worst = max(worst, float((full[key] - value).abs().max()))
    return worst


def default_loss(rank: int, world: int) -> dict:
    """``pm.step(x, target=y)`` trains on the vocab-parallel cross-entropy: its only all-gather is of three
    numbers per token, not of the B×T×V logits that ``forward`` gathers."""
    ref = models.build("gpt")
    x, y = models.tokens(3, 10, 1), models.tokens(3, 10, 2)
    pm = autotp.parallelize(ref, tp=world, vocab="split", example_inputs=x)
    with GatherSizes() as in_forward:
        pm(x)
    with GatherSizes() as in_loss:  # the forward half of step, for a backward of the caller's own
        assert_close(pm.loss(x, target=y), models.loss_fn(ref(x), y), rtol=1e-5, atol=1e-6)
    with GatherSizes() as in_step:
        pm.step(x, target=y)
    for p in pm.parameters():
        p.grad = None
    error = _train(pm, ref, lambda: pm.step(x, target=y), lambda: models.loss_fn(ref(x), y))
    return {"forward": in_forward.sizes, "loss": in_loss.sizes, "step": in_step.sizes, "error": error,
            "overwritable": [g.overwritable for g in pm._output_gathers]}


def user_loss(rank: int, world: int) -> dict:
    """A ``loss_fn`` of the user's sees the whole logits (gathered for it) and trains exactly."""
    ref = models.build("gpt")
    x, y = models.tokens(2, 8, 3), models.tokens(2, 8, 4)
    pm = autotp.parallelize(ref, tp=world, vocab="split", example_inputs=x)

    def smoothed(logits, target):
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten(), label_smoothing=0.1)

    error = _train(pm, ref, lambda: pm.step(x, target=y, loss_fn=smoothed), lambda: smoothed(ref(x), y))
    return {"error": error}


def own_loss(rank: int, world: int) -> dict:
    """A Hugging Face model's own loss (``labels=``, padded with -100) is computed on the split logits inside
    the graph: no logits gather in the step."""
    batch = padded_batch("right")
    torch.manual_seed(0)
    ref = hf_llama()
    pm = autotp.parallelize(ref, tp=world, vocab="split", example_inputs=batch)
    with GatherSizes() as in_step:
        pm.step(**batch)
    for p in pm.parameters():
        p.grad = None
    error = _train(pm, ref, lambda: pm.step(**batch), lambda: ref(**batch, use_cache=False).loss)
    return {"step": in_step.sizes, "error": error}


class SequenceFirstLM(torch.nn.Module):
    """megatron-core's layout: the hidden state as (sequence, batch, hidden), the logits returned as
    ``transpose(0, 1).contiguous()``; with ``also_read`` the logits also feed a second output through ``tanh``
    (an op that saves its result, so the loss may not overwrite the logits)."""

    def __init__(self, also_read: bool = False):
        super().__init__()
        self.also_read = also_read
        self.embed = torch.nn.Embedding(models.VOCAB, 32)
        self.up, self.down = torch.nn.Linear(32, 64), torch.nn.Linear(64, 32)
        self.head = torch.nn.Linear(32, models.VOCAB, bias=False)

    def forward(self, ids):
        h = self.embed(ids).transpose(0, 1)
        h = h + self.down(torch.relu(self.up(h)))
        logits = self.head(h)
        out = logits.transpose(0, 1).contiguous()
        return (out, logits.tanh()) if self.also_read else out


def overwritten_logits(rank: int, world: int) -> dict:
    """The default loss overwrites the split logits only where nothing else reads them, and trains exactly both
    ways; ``forward`` still returns the logits whole."""
    x, y = models.tokens(3, 10, 5), models.tokens(3, 10, 6)
    result = {}
    for also_read in (False, True):
        torch.manual_seed(0)
        ref = SequenceFirstLM(also_read)
        pm = autotp.parallelize(ref, tp=world, vocab="split", example_inputs=x)
        for got, want in zip(torch.utils._pytree.tree_leaves(pm(x)), torch.utils._pytree.tree_leaves(ref(x))):
            assert_close(got, want, rtol=1e-5, atol=1e-6)
        with CommDebugMode():  # a debugging mode of the user's: module hooks and a dispatch mode
            assert_close(pm.step(x, target=y), models.loss_fn(torch.utils._pytree.tree_leaves(ref(x))[0], y),
                         rtol=1e-5, atol=1e-6)
        pm.zero_grad(set_to_none=True)
        error = _train(pm, ref, lambda: pm.step(x, target=y),
                       lambda: models.loss_fn(torch.utils._pytree.tree_leaves(ref(x))[0], y))
        result[str(also_read)] = {"overwritable": [g.overwritable for g in pm._output_gathers], "error": error}
    return result


def loss_parallel_on_ranks(rank: int, world: int) -> dict:
    """Every gloo check of the loss-parallel tests in one spawned group."""
    return {"default": default_loss(rank, world), "user": user_loss(rank, world), "own": own_loss(rank, world),
            "overwritten": overwritten_logits(rank, world)}


CAPTURED_SHAPE = ModelShape(n_layer=2, n_head=4, n_embd=64, vocab_size=512, batch=2, seq=16)
"""examples.gpt's GPT with a vocabulary large enough that gathering its logits would show."""


def _plain(logits, target):
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())


def _summed_ignoring(logits, target):
    return torch.nn.functional.cross_entropy(logits.transpose(1, 2), target, ignore_index=7, reduction="sum") / 10


def _smoothed(logits, target):
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten(), label_smoothing=0.1)


USER_LOSSES = {"plain": _plain, "summed, ignoring a class": _summed_ignoring, "label smoothing": _smoothed}
"""Loss functions of a user's that the vocab-parallel cross-entropy computes on the split logits."""


def captured_user_loss(rank: int, world: int) -> dict:
    """``pm.step(x, target=y, loss_fn=f)`` with ``f`` of the user's: captured with the model, its cross-entropy
    runs on the vocabulary-split logits. Per loss: the step's bytes against Megatron's minimum, what was warned,
    and the largest parameter error after AdamW steps. In float64: the losses train one model in turn (9 steps),
    and in float32 Adam turned the rounding of a near-zero gradient into 1.26e-5 at one element of 65536."""
    shape = CAPTURED_SHAPE
    torch.manual_seed(0)
    ref = build_gpt(**shape.gpt_kwargs()).double()
    gen = torch.Generator().manual_seed(1)
    x, y = (torch.randint(0, shape.vocab_size, (shape.batch, shape.seq), generator=gen) for _ in range(2))
    pm = autotp.parallelize(ref, tp=world, vocab="split", example_inputs=x)
    minimum = sum(per["bytes"] for direction in megatron_minimum(shape, itemsize=8).values() for per in direction.values())
    out = {}
    for name, fn in USER_LOSSES.items():
        with warnings.catch_warnings(record=True) as warned:
            warnings.simplefilter("always")
            pm.loss(x, target=y, loss_fn=fn)  # first use: the model is captured with the loss, outside the count
            counted = count_calls(lambda: pm.step(x, target=y, loss_fn=fn))
        pm.zero_grad(set_to_none=True)
        error = _train(pm, ref, lambda: pm.step(x, target=y, loss_fn=fn), lambda: fn(ref(x), y))
        out[name] = {"ratio": sum(e["bytes"] for e in counted.values()) / minimum, "error": error,
                     "warnings": [str(w.message) for w in warned]}
    return out
