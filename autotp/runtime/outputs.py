"""Model outputs a training step leaves split, so that the loss (``runtime.loss``) is computed on the shards
where it can be.

A rank graph makes every split output whole (an ``OutputGather``). ``forward`` keeps that; a training step
defers those gathers, because it needs only a loss: the model's own (already whole, computed inside the
graph), Megatron's vocab-parallel cross-entropy of the vocabulary-split logits (the default loss: the B×T×V
logits are never gathered), or a user's ``loss_fn``, for which the outputs are gathered after all.
"""

from __future__ import annotations

from collections.abc import Iterable
from contextlib import contextmanager

import torch
from torch import nn
from autotp.torch_private.pytree import tree_map_only

from autotp.rewrite.collectives import OutputGather


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
