"""Dtypes at run time: ``pm.to(dtype)`` (the graphs follow the tensors: see ``Retyped``) and the autocast the rank
graphs run under (a module cast down to bf16, or the mixed-precision policy's compute dtype:
``autotp.mixed_precision``)."""

from __future__ import annotations

import contextlib

import torch
from torch import fx, nn

from autotp.errors import InputError
from autotp.mixed_precision import MixedPrecision
from autotp.rewrite.dtypes import cast_parameters, floating_dtype, retype


_NARROW = (torch.bfloat16, torch.float16)
"""Dtypes autocast computes in: a module cast down to one runs under autocast to it, its graphs' fp32 constants
kept."""


class Retyped:
    """A mixin for the parallel modules: ``pm.to(dtype)`` (``.bfloat16()``, ``.half()``, ``.float()``, ...) casts the
    parameters and buffers as ``nn.Module.to`` does, and the graphs follow:

    - cast down from fp32 to bf16 or fp16, the graphs keep the fp32 constants the model was captured with and run
      under ``torch.autocast`` to the new dtype: matmuls take the bf16 weights in bf16, and what the model upcast
      on purpose (RMSNorm's variance, a softmax in fp32, the loss's ``logits.float()``) stays fp32, as in the
      model converted to bf16 (where it cast to its input's dtype, the graph, captured in fp32, keeps fp32 until
      the next matmul: a little more precise than the converted model);
    - otherwise (to float64, or back up to the captured dtype) every captured-dtype constant becomes the new dtype
      (``rewrite.dtypes.retype``), as the model's own casts to its input's dtype would.
    """

    _captured_dtype: torch.dtype | None = None
    _constants_dtype: torch.dtype | None = None
    _autocast_dtype: torch.dtype | None = None

    def _apply(self, fn, recurse=True):
        before = floating_dtype(self._own_tensors())
        if self._captured_dtype is None:
            self._captured_dtype = before
        if before is not None and _cast_to(fn, before) not in (None, before):
            self._refuse_under_fsdp()  # before any tensor is cast
        result = super()._apply(fn, recurse)
        after = floating_dtype(self._own_tensors())
        if after != before:
            self._set_dtype(after)
        return result

    def retyped(self, graph: fx.GraphModule) -> fx.GraphModule:
        """``graph``, captured in the model's dtype after the module's changed, with its constants as the module's
        other graphs have them."""
        if self._constants_dtype is not None and self._constants_dtype != self._captured_dtype:
            retype(graph, self._captured_dtype, self._constants_dtype)
        return graph

    def precision_autocast(self):
        """The autocast the rank graphs run under: to the dtype the module was cast down to, else the policy's
        compute dtype; none inside a user's own autocast (the user's wins) or with neither."""
        policy = getattr(self, "options", None) and self.options.mixed_precision
        dtype = self._autocast_dtype or (policy.compute if policy is not None else None)
        device = device_type(self)
        if dtype is None or torch.is_autocast_enabled(device):
            return contextlib.nullcontext()
        return torch.autocast(device, dtype=dtype)

    def _own_tensors(self) -> list[torch.Tensor]:
        return [*self.parameters(), *self.buffers()]

    def _refuse_under_fsdp(self) -> None:
        if getattr(self, "fsdp_unit", None) is not None or getattr(self, "_units", None):
            raise InputError("pm.to(dtype) is not supported under dp_mode='fsdp' (FSDP shards and casts the "
                             "parameters itself): pass mixed_precision=autotp.MixedPrecision(param_dtype=...) "
                             "to parallelize, or use dp_mode='replicate'")

    def _set_dtype(self, dtype: torch.dtype) -> None:
        self._refuse_under_fsdp()
        down = dtype in _NARROW and self._captured_dtype not in _NARROW
        self._constants_dtype = self._captured_dtype if down else dtype
        self._autocast_dtype = dtype if down else None
        for graph in self._graphs_to_retype():
            retype(graph, self._captured_dtype, self._constants_dtype)
        self._after_retype()

    def _graphs_to_retype(self) -> list[fx.GraphModule]:
        """Every graph the module runs: its submodules, and the loss graphs built on first use."""
        graphs = [m for m in self.modules() if isinstance(m, fx.GraphModule)]
        losses = getattr(self, "loss_graphs", None)
        graphs += [g for g in getattr(losses, "_graphs", {}).values() if g is not None]
        return graphs

    def _after_retype(self) -> None:
        """A pipeline's schedule is built again. Generation's KV-cache steps are captured from the model, in its
        dtype, with caches of that dtype: after a dtype change ``generate`` re-runs the sequence on the retyped eval
        graph instead (exact, slower; warned)."""
        if getattr(self, "_schedule", None) is not None:
            self._schedule = None  # a pipeline schedule inferred its stages' boundary dtypes: inferred again
        generation = getattr(self, "generation", None)
        if generation is not None and not generation.no_cache:
            generation.cached = None
            generation.no_cache = ("pm.to(dtype) changed the module's dtype, and the KV-cache steps are captured in "
                                   "the model's own; generate re-runs the whole sequence for every token (exact, "
                                   "slower). Convert the model before parallelize to generate with a cache")


def _cast_to(fn, dtype: torch.dtype) -> torch.dtype | None:
    """The dtype ``nn.Module._apply``'s ``fn`` turns a ``dtype`` tensor into (tried on a scalar); None if it
    cannot be told."""
    try:
        return fn(torch.zeros((), dtype=dtype)).dtype
    except Exception:  # noqa: BLE001 - a function for another device or kind of tensor: told after the cast
        return None


def device_type(module: nn.Module) -> str:
    """The device type the module's tensors live on (autocast is per device type)."""
    for t in module.parameters():
        return t.device.type
    return "cpu"


def fsdp_policy(policy: MixedPrecision | None):
    """FSDP2's ``MixedPrecisionPolicy`` for ours: FSDP casts the unsharded parameters to ``param_dtype`` and reduces
    gradients in ``reduce_dtype`` (the compute dtype's autocast is ours, around the graphs)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if policy is None:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=policy.param, reduce_dtype=policy.reduce)


def cast_left_out(graphs: list[fx.GraphModule], ids: set[int], policy: MixedPrecision | None) -> None:
    """Have ``graphs`` read the parameters ``ids`` (ones FSDP leaves out of its sharding: the adapters' whole
    matrices) cast to the policy's ``param_dtype``, as FSDP casts those it shards: the graphs then compute with them
    in that dtype like with the others, and the cast's gradient flows back to the parameter in its own dtype (FSDP's
    cast-back of the reduced gradient). A read through a ``GradSum`` is cast after it."""
    if policy is None or policy.param is None or not ids:
        return
    for gm in graphs:
        cast_parameters(gm, policy.param, only=ids)
