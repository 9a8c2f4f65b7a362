"""Model outputs a training step leaves split: the loss is computed on the shards where it can be.

A rank graph makes every split output whole (an ``OutputGather``). ``forward`` keeps that; a training step
defers those gathers, because it needs only a loss: the model's own (already whole, computed inside the
graph), Megatron's vocab-parallel cross-entropy of the vocabulary-split logits (the default loss: the B×T×V
logits are never gathered), or a user's ``loss_fn``, for which the outputs are gathered after all.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from contextlib import contextmanager

import torch
from torch import nn
from autotp.torch_private.pytree import tree_map_only

from autotp.errors import InputError
from autotp.rewrite.collectives import OutputGather, VocabParallelCrossEntropy


class SplitOutputs:
    """The outputs one deferred run left split, each with the gather that would make it whole."""

    def __init__(self):
        self.recorded: list[tuple[torch.Tensor, OutputGather]] = []

    def gather_of(self, value: torch.Tensor) -> OutputGather | None:
        """The deferred gather of ``value`` (the tensor itself, or a detached alias of it), or None if whole."""
        for split, gather in self.recorded:
            if value is split or (value.data_ptr() == split.data_ptr() and value.shape == split.shape):
                return gather
        return None

    def whole(self, output):
        """``output`` (any nest of tensors) with every split tensor gathered, as ``forward`` returns it."""
        def gathered(value: torch.Tensor) -> torch.Tensor:
            gather = self.gather_of(value)
            return value if gather is None else gather.whole(value)
        return tree_map_only(torch.Tensor, gathered, output)


def output_gathers(modules: Iterable[nn.Module]) -> list[OutputGather]:
    """The output gathers of ``modules`` (rank graphs or pipeline stages)."""
    return [m for root in modules for m in root.modules() if isinstance(m, OutputGather)]


@contextmanager
def deferred(gathers: list[OutputGather]):
    """Within: the outputs of runs of the graphs holding ``gathers`` stay split; yields their record."""
    split = SplitOutputs()
    for gather in gathers:
        gather.deferred = split.recorded
    try:
        yield split
    finally:
        for gather in gathers:
            gather.deferred = None


def logits_of(output) -> torch.Tensor:
    """The logits of a model's output: ``output.logits`` (Hugging Face), the first of a tuple, or the output."""
    logits = getattr(output, "logits", output)
    if isinstance(logits, dict):
        logits = logits.get("logits")
    if isinstance(logits, (tuple, list)):
        logits = logits[0]
    if not isinstance(logits, torch.Tensor):
        raise InputError(f"the default loss is the cross-entropy of the logits, but the model's output is a "
                         f"{type(output).__name__} with no logits; pass loss_fn=")
    return logits


def default_loss(output, target: torch.Tensor, split: SplitOutputs | None = None) -> torch.Tensor:
    """Cross-entropy of the logits against ``target`` (mean over every token). Logits left split along the
    vocabulary are not gathered: Megatron's vocab-parallel cross-entropy computes the same loss from the
    shards."""
    logits = logits_of(output)
    gather = split.gather_of(logits) if split is not None else None
    if gather is not None and gather.dim == logits.dim() - 1 and len(gather.segments) == 1 and not gather.blocked:
        if target.numel() != logits.shape[:-1].numel():
            raise InputError(f"the default loss takes one target class per logits row: logits of shape "
                             f"{tuple(logits.shape)} need {logits.shape[:-1].numel()} targets, got a target of "
                             f"shape {tuple(target.shape)}")
        # Classes last, in whatever layout the model left them (no B×T×V/tp copy to flatten them).
        loss = VocabParallelCrossEntropy(gather.comm, classes=gather.segments[0], overwrite=gather.overwritable)
        return loss(logits.movedim(-1, 1), target.reshape(logits.shape[:-1]))
    if gather is not None:  # split some other way: made whole for the plain loss
        logits = gather.whole(logits)
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def user_loss(loss_fn: Callable, output, target: torch.Tensor, split: SplitOutputs | None) -> torch.Tensor:
    """``loss_fn`` on the output as the model returns it: every split output gathered first."""
    return loss_fn(split.whole(output) if split is not None else output, target)


def model_loss(output) -> torch.Tensor | None:
    """The loss the model computed itself (a Hugging Face model given ``labels``: ``output.loss``), or None."""
    if isinstance(output, dict):
        return output.get("loss")
    return getattr(output, "loss", None)


def step_loss(output, target: torch.Tensor | None, loss_fn: Callable | None,
              split: SplitOutputs | None = None) -> torch.Tensor:
    """The loss ``step`` trains on: ``loss_fn`` (default: cross-entropy) against ``target`` when given, else the
    model's own (computed from ``labels`` inside the model). ``split``: the outputs the step left split."""
    if target is not None:
        if loss_fn is None:
            return checked_loss(default_loss(output, target, split))
        return checked_loss(user_loss(loss_fn, output, target, split))
    if loss_fn is not None:
        raise InputError("loss_fn is called as loss_fn(output, target), but no target= was given; pass target=")
    loss = model_loss(output)
    if loss is None:
        raise InputError("step needs a loss: pass target= (with the default cross-entropy or your loss_fn), or "
                         "labels= to a model that computes its own loss (a Hugging Face model's output.loss); "
                         "this model's output has no loss")
    return checked_loss(loss)


def checked_loss(loss) -> torch.Tensor:
    """A loss function's result, which must be a scalar tensor with a gradient to follow."""
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        got = f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise InputError(f"loss_fn must return a scalar tensor (e.g. a mean), got {got}; reduce it with .mean() or "
                         ".sum() inside loss_fn")
    if not loss.requires_grad:
        raise InputError("loss_fn returned a tensor with no gradient history (made with .item(), .detach() or "
                         "torch.no_grad?); compute it from the model's output with torch operations")
    return loss
