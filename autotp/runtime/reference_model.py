"""A frozen reference of a parallel module for preference training (TRL's DPOTrainer ``ref_model=``): the module's
graphs and frozen shards, with copies of its trainable parameters as they are when the reference is made.

peft's DPOTrainer keeps its reference as a frozen copy of the adapter beside the trained one; this is the same: the
reference holds a copy of each trainable tensor of this rank (the adapters' shards), and its forward runs the
module's own graphs reading those copies in place of the trained tensors (``peft_habits.reading``). The frozen base
is shared, so a reference costs the adapters' memory, not a second base. The trained tensors are never written, so
a policy forward made before the reference's backpropagates correctly after it.
"""

from __future__ import annotations

import torch
from torch import nn

from autotp.errors import InputError
from autotp.runtime.fused_head import fused_forward, is_fused_head
from autotp.runtime.peft_habits import reading


class ReferenceModel(nn.Module):
    """``pm`` as it was when this was made, frozen (module docstring). Call it as ``pm``; TRL's fused LM head is
    computed from its logits as on ``pm``."""

    def __init__(self, pm):
        super().__init__()
        held = pm._holders()
        # The module is not a child: its parameters are not the reference's (an optimizer or accelerate walking the
        # reference's parameters finds none)
        self.__dict__["_pm"] = pm
        self.__dict__["_copies"] = {id(t): nn.Parameter(t.detach().clone(), requires_grad=False)
                                    for tensors in held.values() for t in tensors if t.requires_grad}

    def __setattr__(self, name: str, value) -> None:
        if name == "forward" and is_fused_head(value):  # TRL's add_fused_lm_head on its ref_model
            value = fused_forward(self, value)
        super().__setattr__(name, value)

    def forward(self, *args, **kwargs):
        """``pm``'s forward, reading the frozen copies in place of its trainable tensors."""
        with reading(self._pm, self._copies):
            return self._pm(*args, **kwargs)

    @property
    def config(self):
        """The module's ``config`` (TRL reads it)."""
        return self._pm.config

    def add_model_tags(self, tags) -> None:
        """Tags for a model card: kept by the module itself."""


def reference_model(pm) -> ReferenceModel:
    """``pm``'s frozen reference (``ReferenceModel``); refused under ``dp_mode='fsdp'``, whose units own the
    parameters the graphs read."""
    mode = getattr(pm.options, "dp_mode", None)
    if pm.options.dp > 1 and getattr(mode, "value", mode) == "fsdp":
        raise InputError("reference_model() under dp_mode='fsdp' is not supported (FSDP owns the parameters the "
                         "graph reads): use dp_mode='replicate', or a second parallel module of the reference")
    if not any(p.requires_grad for p in pm.parameters()):
        raise InputError("reference_model(): nothing in this module trains, so it is its own reference; pass it "
                         "as it is")
    return ReferenceModel(pm)
