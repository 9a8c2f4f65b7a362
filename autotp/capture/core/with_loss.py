"""A user's loss function captured with the model: one graph from the inputs and the target to the loss (the
capture step of ``runtime.loss.LossGraphs``, where the loss is owned).

``pm.step(x, target=y, loss_fn=f)`` trains on ``f(model(x), y)``. Captured apart from the model, ``f`` would get
the model's outputs whole, so vocabulary-split logits would be all-gathered for it; captured together, a
cross-entropy inside ``f`` is an op of the graph, and the vocab-parallel rule runs it on the split logits.
The wrapper holds the model's own children and tensors under their own names, so the graph reads every
parameter by the name the plan keys it by.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from autotp.capture.core.captured import Captured
from autotp.capture.core.export import capture, model_kwargs


class _WithLoss(nn.Module):
    """``loss_fn(model(**inputs), target)`` over flat inputs (the model's, named by ``names``, then the target).

    The model's children, parameters and buffers are this module's own (the same objects, the same names); the
    model itself is kept out of the module tree so that no name gains a prefix."""

    def __init__(self, model: nn.Module, names: tuple[str, ...], loss_fn: Callable):
        super().__init__()
        for name, child in model.named_children():
            self.add_module(name, child)
        for name, param in model.named_parameters(recurse=False):
            self.register_parameter(name, param)
        for name, buffer in model.named_buffers(recurse=False):
            self.register_buffer(name, buffer, persistent=name not in model._non_persistent_buffers_set)
        self._call = (model, names, loss_fn, model_kwargs(model))  # a tuple: not registered as a submodule
        self._own = tuple(name for name, _ in (*model.named_parameters(recurse=False),
                                                *model.named_buffers(recurse=False)))

    def forward(self, *flat):
        model, names, loss_fn, fixed = self._call
        # torch.export traces this module's tensors (its children's are the model's own objects); the model's own
        # top-level tensors are read through this module's, or the graph would hold them as constants
        own = {name: getattr(self, name) for name in self._own}
        output = torch.func.functional_call(model, own, (), {**dict(zip(names, flat[:-1])), **fixed})
        return loss_fn(output, flat[-1])


def capture_with_loss(model: nn.Module, names: tuple[str, ...], flat: tuple[torch.Tensor, ...],
                      target: torch.Tensor, loss_fn: Callable, training: bool) -> Captured:
    """Capture ``loss_fn(model(**dict(zip(names, flat))), target)``: placeholders are ``flat`` then ``target``,
    and parameters keep the model's names. Raises ``CaptureError`` when torch.export cannot trace it."""
    wrapper = _WithLoss(model, names, loss_fn)
    wrapper.train(model.training)
    return capture(wrapper, (*flat, target), training=training)
