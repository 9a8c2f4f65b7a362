"""Dtypes at run time: ``pm.to(dtype)`` (the graphs' dtype constants follow the tensors) and the mixed-precision
policy's autocast around the rank graphs (``autotp.mixed_precision``)."""

from __future__ import annotations

import contextlib

import torch
from torch import fx, nn

from autotp.errors import InputError
from autotp.mixed_precision import MixedPrecision
from autotp.rewrite.dtypes import floating_dtype, retype


class Retyped:
    """A mixin for the parallel modules: ``pm.to(torch.bfloat16)`` (``.half()``, ``.float()``, ...) casts the
    parameters and buffers as ``nn.Module.to`` does, and every rank graph's dtype constants with them
    (``rewrite.dtypes.retype``), so the module runs in the new dtype; ``pm.to(torch.float32)`` goes back."""

    _captured_dtype: torch.dtype | None = None

    def _apply(self, fn, recurse=True):
        before = floating_dtype(self._own_tensors())
        if self._captured_dtype is None:
            self._captured_dtype = before
        result = super()._apply(fn, recurse)
        after = floating_dtype(self._own_tensors())
        if after != before:
            self._retype_graphs(after)
        return result

    def retyped(self, graph: fx.GraphModule) -> fx.GraphModule:
        """``graph``, built after the module's dtype changed from the captured one, with its constants retyped."""
        now = floating_dtype(self._own_tensors())
        if self._captured_dtype is not None and now != self._captured_dtype:
            retype(graph, self._captured_dtype, now)
        return graph

    def _own_tensors(self) -> list[torch.Tensor]:
        return [*self.parameters(), *self.buffers()]

    def _retype_graphs(self, dtype: torch.dtype) -> None:
        if getattr(self, "fsdp_unit", None) is not None or getattr(self, "_units", None):
            raise InputError("pm.to(dtype) is not supported under dp_mode='fsdp' (FSDP shards and casts the "
                             "parameters itself): pass mixed_precision=autotp.MixedPrecision(param_dtype=...) "
                             "to parallelize, or use dp_mode='replicate'")
        for graph in self._graphs_to_retype():
            retype(graph, self._captured_dtype, dtype)
        self._after_retype()

    def _graphs_to_retype(self) -> list[fx.GraphModule]:
        """Every graph the module runs: its submodules, and the loss graphs built on first use."""
        graphs = [m for m in self.modules() if isinstance(m, fx.GraphModule)]
        losses = getattr(self, "loss_graphs", None)
        graphs += [g for g in getattr(losses, "_graphs", {}).values() if g is not None]
        return graphs

    def _after_retype(self) -> None:
        """Generation's KV-cache steps are captured from the model, in its dtype, with caches of that dtype: after a
        dtype change ``generate`` re-runs the sequence on the retyped eval graph instead (exact, slower; warned)."""
        generation = getattr(self, "generation", None)
        if generation is not None and not generation.no_cache:
            generation.cached = None
            generation.no_cache = ("pm.to(dtype) changed the module's dtype, and the KV-cache steps are captured in "
                                   "the model's own; generate re-runs the whole sequence for every token (exact, "
                                   "slower). Convert the model before parallelize to generate with a cache")


def device_type(module: nn.Module) -> str:
    """The device type the module's tensors live on (autocast is per device type)."""
    for t in module.parameters():
        return t.device.type
    return "cpu"


def policy_autocast(policy: MixedPrecision | None, device: str):
    """The autocast a policy runs the rank graphs under (a no-op without a compute dtype); inside a user's
    own autocast, the user's wins (nothing is entered)."""
    if policy is None or policy.compute_dtype is None or torch.is_autocast_enabled(device):
        return contextlib.nullcontext()
    return torch.autocast(device, dtype=policy.compute)


def fsdp_policy(policy: MixedPrecision | None):
    """FSDP2's ``MixedPrecisionPolicy`` for ours: FSDP casts the unsharded parameters to ``param_dtype`` and reduces
    gradients in ``reduce_dtype`` (the compute dtype's autocast is ours, around the graphs)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if policy is None:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=policy.param, reduce_dtype=policy.reduce)
