"""Process-wide replacements of torch internals made while a model is captured, each put back after, and the lock
that keeps two captures from making them at once.

A replacement changes torch for the whole process: ``Function.apply`` recording into one capture's set, another
capture's shape kernels registered in the middle of a trace. Each one here therefore holds ``CAPTURE_LOCK`` (a
re-entrant lock) while it is in place, and every capture holds it throughout (``capturing``): two threads that
capture at once capture one after the other, each with the replacements it made and nothing of the other's.
"""

from __future__ import annotations

import contextlib
import functools
import threading

import torch

from autotp.torch_private.entries import FIRST_RELEASE, FIRST_RELEASES, constant, fenced
from autotp.torch_private.graph_facts import changed, distribution_validation

CAPTURE_LOCK = threading.RLock()
"""Held by a capture from start to end and by every replacement while it is in place (re-entrant: a capture
nests them)."""


def capturing():
    """The capture lock, held for the body: another thread's capture waits for this one to end."""
    return CAPTURE_LOCK


def locked(function):
    """A context manager made of the generator ``function``, holding ``CAPTURE_LOCK`` while it is open."""
    body = contextlib.contextmanager(function)

    @functools.wraps(function)
    @contextlib.contextmanager
    def run(*args, **kwargs):
        with CAPTURE_LOCK, body(*args, **kwargs) as value:
            yield value
    return run


@fenced("Function.__dict__['apply'], a class-level descriptor (classmethod in 2.13, torch._C._FunctionBase's C "
        "classmethod_descriptor from 2.14) that can be replaced and put back", replaces=True)
@locked
def applied_functions(found: set[str]):
    """Record in ``found`` the user-defined ``torch.autograd.Function`` subclasses applied inside the block: a
    non-strict ``torch.export`` traces their forward only, so their own backward does not reach the graph. torch's
    own and autotp's (the shape-kernel stand-in, applied only while tracing) are not the user's. The original is
    bound through the descriptor protocol (``__get__(None, cls)``), so it runs exactly as an unpatched call."""
    original = torch.autograd.Function.__dict__.get("apply")
    if not hasattr(original, "__get__"):
        raise changed("where autograd Functions keep apply", f"Function.__dict__['apply'] is {original!r}")

    def apply(cls, *args, **kwargs):
        if not cls.__module__.startswith(("torch.", "autotp.")):
            found.add(f"{cls.__module__}.{cls.__qualname__}")
        return original.__get__(None, cls)(*args, **kwargs)

    torch.autograd.Function.apply = classmethod(apply)
    try:
        yield
    finally:
        torch.autograd.Function.apply = original


@fenced("nn.Module.to replaced; torch._C._nn._parse_to, what Module.to parses its arguments with", replaces=True)
@locked
def unchanged_module_casts():
    """``module.to(...)`` that would convert no parameter or buffer returns the module as it is.

    A forward may cast a submodule to the dtype it already has, every step (Switch Transformers' router:
    ``self.classifier = self.classifier.to(self.dtype)``, for fp32 routing under mixed precision). Run, that is a
    no-op; traced by torch.export, ``Module._apply`` tries to swap each fake parameter for its "converted" self and
    fails. A cast that changes nothing has nothing to record, so it is skipped while capturing; a real conversion
    still goes through (and fails the capture as before)."""
    parse = getattr(torch._C._nn, "_parse_to", None)
    if parse is None:
        raise changed("how Module.to parses its arguments", "torch._C._nn._parse_to")
    original = torch.nn.Module.to

    def to(module, *args, **kwargs):
        device, dtype, _non_blocking, memory_format = parse(*args, **kwargs)
        tensors = [*module.parameters(), *module.buffers()]
        if memory_format is None and all(_kept(t, device, dtype) for t in tensors):
            return module
        return original(module, *args, **kwargs)

    torch.nn.Module.to = to
    try:
        yield
    finally:
        torch.nn.Module.to = original


def _kept(tensor: torch.Tensor, device, dtype) -> bool:
    """Whether ``Module.to(device, dtype)`` leaves ``tensor`` as it is (it casts floating and complex tensors only)."""
    same_device = device is None or tensor.device == device
    same_dtype = dtype is None or not (tensor.is_floating_point() or tensor.is_complex()) or tensor.dtype == dtype
    return same_device and same_dtype


@fenced("torch.distributions.Distribution.set_default_validate_args, a process-wide default", replaces=True)
@locked
def distribution_checks_off():
    """torch.distributions' argument validation off while a model is captured (restored after). The check only
    raises on arguments outside a distribution's support (BLT's ``Categorical(logits=...).entropy()`` checks its
    logits are real numbers, not NaN), computes nothing the forward uses, and asks ``.all()`` of a tensor, a
    branch on data that export cannot trace; the captured graph computes the same values without it."""
    previous = distribution_validation()
    torch.distributions.Distribution.set_default_validate_args(False)
    try:
        yield
    finally:
        torch.distributions.Distribution.set_default_validate_args(previous)


@fenced("torch.fx.experimental.sym_node's module-level dtrace_structured, which draft_export's expression tracing "
        "calls", FIRST_RELEASES, replaces=True)
@locked
def expression_tracing_off():
    """draft_export traces every symbolic expression it creates (``expression_created``, with its user and
    framework stacks) to explain its report's failures; autotp reads only the failures' kinds, and that tracing
    was 85% of a tiny wav2vec2's fallback capture (33 of 38 s). Silenced here; every other trace is kept."""
    from torch.fx.experimental import sym_node

    traced = getattr(sym_node, "dtrace_structured", None)  # private: the module's own import of the tracer
    if traced is None:
        raise changed("how symbolic expressions are traced", "torch.fx.experimental.sym_node.dtrace_structured")

    def untraced_expressions(name, *args, **kwargs):
        if name != "expression_created":
            traced(name, *args, **kwargs)

    sym_node.dtrace_structured = untraced_expressions
    try:
        yield
    finally:
        sym_node.dtrace_structured = traced


DECOMPOSITIONS_UNSOUND_IN_DRAFT_EXPORT = ("div.Tensor_mode", "div.Scalar_mode", "floor_divide.default")
"""Ops whose Python decomposition fails under draft_export's real-tensor propagation (torch 2.13): an integer
floor division by a Python number (``torch.div(lengths - k, stride, rounding_mode="floor")``, every CTC head's
output lengths) makes an unbacked symbol it never returns (``PendingUnbackedSymbolNotFound``). Their C++ meta
kernels handle symbolic sizes, so the fake tensors use those instead."""


@fenced("torch._decomp.decomposition_table, the table fake tensors consult first", FIRST_RELEASES, replaces=True)
@locked
def decompositions_off(names=DECOMPOSITIONS_UNSOUND_IN_DRAFT_EXPORT):
    """The Python decompositions of the aten ops ``names`` (``"div.Tensor_mode"``) out of torch's table while
    inside (restored after), so fake tensors run those ops' own meta kernels."""
    from torch._decomp import decomposition_table

    ops = [getattr(getattr(torch.ops.aten, packet), overload)
           for packet, overload in (name.split(".") for name in names)]
    saved = {op: decomposition_table.pop(op) for op in ops if op in decomposition_table}
    try:
        yield
    finally:
        decomposition_table.update(saved)


LAYOUT_PROBES = ("check_contiguous_sizes_strides", "is_channels_last_contiguous_2d", "is_channels_last_contiguous_3d",
                 "compute_elementwise_output_logical_to_physical_perm")
"""The functions of ``torch._prims_common`` that pick an output's memory layout by asking whether an input is
contiguous (row-major, or channels-last for 4-D and 5-D values)."""
constant("LAYOUT_PROBES", "torch._prims_common's four layout probes, by name", FIRST_RELEASE)


@fenced("torch._prims_common's LAYOUT_PROBES replaced; torch.fx.experimental._config.patch(backed_size_oblivious)",
        FIRST_RELEASE, replaces=True)
@locked
def sizes_not_fixed_by_probes():
    """Tracing where torch's layout probes (``LAYOUT_PROBES``) do not guard on the example's sizes: they take their
    "guard, or take a default" checks' defaults (set around those functions alone). A probe only picks an output
    layout, which is safe either way: whether ``mask[:T, :T]`` of a 16x16 buffer is contiguous (stride 16 against
    T). Guarded at T = 16 it fixes the sequence at the buffer's length, and at T = 8 it excludes 16. Every other
    check guards as before (the slice's own ``T <= 16``, the model's branches), so sizes stay ``T``."""
    from torch import _prims_common
    from torch.fx.experimental import _config

    probes = {name: getattr(_prims_common, name, None) for name in LAYOUT_PROBES}
    if None in probes.values() or not isinstance(getattr(_config, "backed_size_oblivious", None), bool):
        # the capture catches this and keeps its first trace; tests/test_sequence_full_context.py fails on it
        raise changed("how layout probes guard", f"torch._prims_common.{'/'.join(LAYOUT_PROBES)}")

    def unguarded(probe):
        def run(*args, **kwargs):
            with _config.patch(backed_size_oblivious=True):
                return probe(*args, **kwargs)
        return run

    for name, probe in probes.items():
        setattr(_prims_common, name, unguarded(probe))
    try:
        yield
    finally:
        for name, probe in probes.items():
            setattr(_prims_common, name, probe)


@fenced("torch.library.Library('aten', 'FRAGMENT') + register_fake; Library._destroy, the only way to take the "
        "registrations back", FIRST_RELEASES, replaces=True)
@locked
def fake_kernels_registered(kernels: dict):
    """``kernels`` (op name -> fake kernel) registered while inside, removed after."""
    library = torch.library.Library("aten", "FRAGMENT")
    try:
        for name, kernel in kernels.items():
            torch.library.register_fake(name, kernel, lib=library)
        yield
    finally:
        library._destroy()


@fenced("torch.Tensor's and torch.SymBool's methods replaced by assignment on the class", replaces=True)
@locked
def methods_replaced(replacements: dict):
    """Each ``(owner, name) -> function`` of ``replacements`` set as ``owner.name`` while inside (a torch class's
    method: ``(torch.Tensor, "nonzero")``), the originals put back after."""
    originals = {(owner, name): owner.__dict__.get(name, _INHERITED) for owner, name in replacements}
    for (owner, name), function in replacements.items():
        setattr(owner, name, function)
    try:
        yield
    finally:
        for (owner, name), function in originals.items():
            if function is _INHERITED:  # a method the class inherits (Tensor.nonzero is TensorBase's): inherit again
                delattr(owner, name)
            else:
                setattr(owner, name, function)


_INHERITED = object()
"""Marks a replaced method the class did not define itself."""
