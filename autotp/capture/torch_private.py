"""Every private torch API autotp relies on, in one place, each checked where it is read.

torch.export gives what autotp needs, but four facts are reachable only through private attributes:
the sympy expression behind a symbolic size, which arguments an op writes in place (its schema), the
output tree spec of an exported module, and the name of the input-guard submodule it adds. If a torch release changes one, the accessor raises
``InternalError`` naming the torch version (and ``tests/test_capture.py`` fails loudly), instead of
autotp silently computing something else.
"""

from __future__ import annotations

import contextlib

import sympy
import torch
from torch import fx

from autotp.errors import InternalError

TENSOR_DATA = torch._C.TensorBase.data
"""The ``.data`` property of tensors (its getter and setter reach a TorchFunctionMode as methods of it)."""

GUARDS_MODULE = "_guards_fn"
"""The submodule torch.export adds to check input shapes; it belongs to the whole model, not to a stage."""


def _changed(what: str, detail: str) -> InternalError:
    return InternalError(f"torch {torch.__version__} changed {what} ({detail}); autotp needs updating for it")


def size_expr(size) -> int | sympy.Expr:
    """A tensor size as an int, or as the sympy expression of a symbolic size (``s70*s72``)."""
    if isinstance(size, int):
        return int(size)
    expr = getattr(getattr(size, "node", None), "expr", None)  # private: SymInt.node.expr
    if not isinstance(expr, sympy.Expr):
        raise _changed("how symbolic sizes expose their expression", f"{type(size).__name__}.node.expr")
    return int(expr) if expr.is_Integer else expr


def plain_sizes(value: torch.Tensor) -> tuple:
    """The sizes of an example tensor as ints and sympy expressions."""
    return tuple(size_expr(d) for d in value.shape)


def mutated_args(node: fx.Node) -> tuple:
    """The argument paths (``(i,)`` or ``("kw", name)``) that ``node``'s op writes to in place."""
    schema = getattr(node.target, "_schema", None)  # private: OpOverload._schema
    if schema is None:
        return ()
    paths = []
    for i, arg in enumerate(schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            paths.append((i,) if i < len(node.args) else ("kw", arg.name))
    return tuple(paths)


def output_spec(module: fx.GraphModule):
    """The pytree spec of an exported module's outputs (to rebuild them from a flat list)."""
    spec = getattr(module, "_out_spec", None)  # private: set by ExportedProgram.module()
    if spec is None:
        raise _changed("where an exported module keeps its output spec", "GraphModule._out_spec")
    return spec


def is_guard_call(node: fx.Node) -> bool:
    """Whether ``node`` calls the export's input-shape guard module."""
    return node.op == "call_module" and node.target == GUARDS_MODULE


@contextlib.contextmanager
def applied_functions(found: set[str]):
    """Record in ``found`` the user-defined ``torch.autograd.Function`` subclasses applied inside the block: a
    non-strict ``torch.export`` traces their forward only, so their own backward does not reach the graph. torch's
    own and autotp's (``shape_kernels``' stand-in, applied only while tracing) are not the user's."""
    original = torch.autograd.Function.__dict__["apply"]

    def apply(cls, *args, **kwargs):
        if not cls.__module__.startswith(("torch.", "autotp.")):
            found.add(f"{cls.__module__}.{cls.__qualname__}")
        return original.__func__(cls, *args, **kwargs)

    torch.autograd.Function.apply = classmethod(apply)
    try:
        yield
    finally:
        torch.autograd.Function.apply = original


def distribution_validation() -> bool:
    """torch.distributions' default for validating a distribution's arguments (private:
    ``Distribution._validate_args``; ``set_default_validate_args`` is its public setter)."""
    value = getattr(torch.distributions.Distribution, "_validate_args", None)
    if not isinstance(value, bool):
        raise _changed("where distributions keep their validation default", "Distribution._validate_args")
    return value


@contextlib.contextmanager
def expression_tracing_off():
    """draft_export traces every symbolic expression it creates (``expression_created``, with its user and
    framework stacks) to explain its report's failures; autotp reads only the failures' kinds, and that tracing
    was 85% of a tiny wav2vec2's fallback capture (33 of 38 s). Silenced here; every other trace is kept."""
    from torch.fx.experimental import sym_node

    traced = getattr(sym_node, "dtrace_structured", None)  # private: the module's own import of the tracer
    if traced is None:
        raise _changed("how symbolic expressions are traced", "torch.fx.experimental.sym_node.dtrace_structured")

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


@contextlib.contextmanager
def decompositions_off(names=DECOMPOSITIONS_UNSOUND_IN_DRAFT_EXPORT):
    """The Python decompositions of the aten ops ``names`` (``"div.Tensor_mode"``) out of torch's table while
    inside (restored after), so fake tensors run those ops' own meta kernels."""
    from torch._decomp import decomposition_table  # private: the table fake tensors consult first

    ops = [getattr(getattr(torch.ops.aten, packet), overload)
           for packet, overload in (name.split(".") for name in names)]
    saved = {op: decomposition_table.pop(op) for op in ops if op in decomposition_table}
    try:
        yield
    finally:
        decomposition_table.update(saved)


@contextlib.contextmanager
def unchanged_module_casts():
    """``module.to(...)`` that would convert no parameter or buffer returns the module as it is.

    A forward may cast a submodule to the dtype it already has, every step (Switch Transformers' router:
    ``self.classifier = self.classifier.to(self.dtype)``, for fp32 routing under mixed precision). Run, that is a
    no-op; traced by torch.export, ``Module._apply`` tries to swap each fake parameter for its "converted" self and
    fails. A cast that changes nothing has nothing to record, so it is skipped while capturing; a real conversion
    still goes through (and fails the capture as before). ``torch._C._nn._parse_to`` is private: it is what
    ``Module.to`` itself parses its arguments with."""
    parse = getattr(torch._C._nn, "_parse_to", None)
    if parse is None:
        raise _changed("how Module.to parses its arguments", "torch._C._nn._parse_to")
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


def active_ddp_module():
    """The DistributedDataParallel module whose forward is running (calling this one), or None.

    Private: ``DistributedDataParallel._active_ddp_module``, which DDP sets around its wrapped module's call
    (for torch.compile's DDP optimiser); checked on torch 2.13. A release without it raises ``InternalError``
    here, rather than a DDP wrap going unnoticed.
    """
    from torch.nn.parallel import DistributedDataParallel

    if not hasattr(DistributedDataParallel, "_active_ddp_module"):
        raise _changed("how DistributedDataParallel marks its running forward",
                       "DistributedDataParallel._active_ddp_module")
    return DistributedDataParallel._active_ddp_module
