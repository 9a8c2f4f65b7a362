"""Every private torch API autotp relies on, in one place, each checked where it is read.

torch.export gives what autotp needs, but four facts are reachable only through private attributes:
the sympy expression behind a symbolic size, which arguments an op writes in place (its schema), the
output tree spec of an exported module, and the name of the input-guard submodule it adds; a few context managers
patch torch's own functions while capturing. If a torch release changes one, the accessor raises ``InternalError``
naming the torch version (and ``tests/test_capture.py`` fails loudly), instead of autotp silently computing
something else. Each entry says what it relies on and the torch releases it was checked on (CI runs the capture,
checker, generation and MoE tests on every release in ``autotp.torch_version.TESTED_TORCH``).
"""

from __future__ import annotations

import contextlib
import re

import sympy
import torch
from torch import fx

from autotp.errors import InternalError

TENSOR_DATA = torch._C.TensorBase.data
"""The ``.data`` property of tensors (its getter and setter reach a TorchFunctionMode as methods of it).
Checked on 2.13.0 and 2.14.1."""

GUARDS_MODULE = "_guards_fn"
"""The submodule torch.export adds to check input shapes; it belongs to the whole model, not to a stage.
Checked on 2.13.0 and 2.14.1."""


def _changed(what: str, detail: str) -> InternalError:
    return InternalError(f"torch {torch.__version__} changed {what} ({detail}); autotp needs updating for it")


def size_expr(size) -> int | sympy.Expr:
    """A tensor size as an int, or as the sympy expression of a symbolic size (``s70*s72``). Relies on
    ``SymInt.node.expr``; checked on 2.13.0 and 2.14.1."""
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
    """The argument paths (``(i,)`` or ``("kw", name)``) that ``node``'s op writes to in place. Relies on
    ``OpOverload._schema``'s alias annotations; checked on 2.13.0 and 2.14.1."""
    schema = getattr(node.target, "_schema", None)  # private: OpOverload._schema
    if schema is None:
        return ()
    paths = []
    for i, arg in enumerate(schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            paths.append((i,) if i < len(node.args) else ("kw", arg.name))
    return tuple(paths)


def output_spec(module: fx.GraphModule):
    """The pytree spec of an exported module's outputs (to rebuild them from a flat list). Relies on the
    ``_out_spec`` that ``ExportedProgram.module()`` sets; checked on 2.13.0 and 2.14.1."""
    spec = getattr(module, "_out_spec", None)  # private: set by ExportedProgram.module()
    if spec is None:
        raise _changed("where an exported module keeps its output spec", "GraphModule._out_spec")
    return spec


def is_guard_call(node: fx.Node) -> bool:
    """Whether ``node`` calls the export's input-shape guard module (``GUARDS_MODULE``)."""
    return node.op == "call_module" and node.target == GUARDS_MODULE


@contextlib.contextmanager
def applied_functions(found: set[str]):
    """Record in ``found`` the user-defined ``torch.autograd.Function`` subclasses applied inside the block: a
    non-strict ``torch.export`` traces their forward only, so their own backward does not reach the graph. torch's
    own and autotp's (``shape_kernels``' stand-in, applied only while tracing) are not the user's.

    Relies on ``Function.apply`` being a class-level descriptor in ``Function.__dict__`` that can be replaced and
    put back: a Python ``classmethod`` in torch 2.13, ``torch._C._FunctionBase``'s C ``classmethod_descriptor``
    in 2.14 (which has no ``__func__``). Either binds to ``cls`` through the descriptor protocol
    (``__get__(None, cls)``), so the original runs exactly as an unpatched call would. Checked on 2.13.0, 2.14.1."""
    original = torch.autograd.Function.__dict__.get("apply")
    if not hasattr(original, "__get__"):
        raise _changed("where autograd Functions keep apply", f"Function.__dict__['apply'] is {original!r}")

    def apply(cls, *args, **kwargs):
        if not cls.__module__.startswith(("torch.", "autotp.")):
            found.add(f"{cls.__module__}.{cls.__qualname__}")
        return original.__get__(None, cls)(*args, **kwargs)

    torch.autograd.Function.apply = classmethod(apply)
    try:
        yield
    finally:
        torch.autograd.Function.apply = original


def distribution_validation() -> bool:
    """torch.distributions' default for validating a distribution's arguments (private:
    ``Distribution._validate_args``; ``set_default_validate_args`` is its public setter). Checked on 2.13.0 and
    2.14.1."""
    value = getattr(torch.distributions.Distribution, "_validate_args", None)
    if not isinstance(value, bool):
        raise _changed("where distributions keep their validation default", "Distribution._validate_args")
    return value


@contextlib.contextmanager
def expression_tracing_off():
    """draft_export traces every symbolic expression it creates (``expression_created``, with its user and
    framework stacks) to explain its report's failures; autotp reads only the failures' kinds, and that tracing
    was 85% of a tiny wav2vec2's fallback capture (33 of 38 s). Silenced here; every other trace is kept. Relies on
    ``sym_node`` calling its module-level ``dtrace_structured``; checked on 2.13.0 and 2.14.1."""
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
    inside (restored after), so fake tensors run those ops' own meta kernels. Relies on
    ``torch._decomp.decomposition_table`` being the table fake tensors consult; checked on 2.13.0 and 2.14.1."""
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
    ``Module.to`` itself parses its arguments with. Checked on 2.13.0 and 2.14.1."""
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


LAYOUT_PROBES = ("check_contiguous_sizes_strides", "is_channels_last_contiguous_2d", "is_channels_last_contiguous_3d",
                 "compute_elementwise_output_logical_to_physical_perm")
"""The functions of ``torch._prims_common`` (private; checked on torch 2.13) that pick an output's memory layout
by asking whether an input is contiguous (row-major, or channels-last for 4-D and 5-D values)."""


@contextlib.contextmanager
def sizes_not_fixed_by_probes():
    """Tracing where torch's layout probes (``LAYOUT_PROBES``) do not guard on the example's sizes: they take their
    "guard, or take a default" checks' defaults (``torch.fx.experimental._config.backed_size_oblivious``, private,
    set around those functions alone). A probe only picks an output layout, which is safe either way: whether
    ``mask[:T, :T]`` of a 16x16 buffer is contiguous (stride 16 against T). Guarded at T = 16 it fixes the
    sequence at the buffer's length, and at T = 8 it excludes 16. Every other check guards as before (the slice's
    own ``T <= 16``, the model's branches), so sizes stay ``T`` rather than ``Min(16, T)``."""
    from torch import _prims_common
    from torch.fx.experimental import _config

    probes = {name: getattr(_prims_common, name, None) for name in LAYOUT_PROBES}
    if None in probes.values() or not isinstance(getattr(_config, "backed_size_oblivious", None), bool):
        # the capture catches this and keeps its first trace; tests/test_sequence_full_context.py fails on it
        raise _changed("how layout probes guard", f"torch._prims_common.{'/'.join(LAYOUT_PROBES)}")

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


_EXCLUDED = re.compile(r"L\['inputs'\]\[(\d+)\]\.size\(\)\[(\d+)\] != (\d+)")
"""An input guard excluding one size of one input: ``L['inputs'][0].size()[1] != 16`` (the capture wrapper takes its
inputs as ``*inputs``)."""


def excluded_sizes(program: torch.export.ExportedProgram) -> tuple[tuple[int, int, int], ...]:
    """``(input, dim, size)`` for each input guard of an exported program that excludes one size above 1 (sizes 0
    and 1 are excluded from every dynamic size anyway): a layout probe's guard at an example shorter than a table,
    ``L['inputs'][0].size()[1] != 16``. torch keeps the guards as code in ``ExportedProgram._guards_code``
    (private; checked on torch 2.13). A release without it finds none: captures go on as before, the second trace
    is then made only for fixed sizes (and tests/test_sequence_full_context.py fails, saying so)."""
    code = getattr(program, "_guards_code", None)
    if not isinstance(code, list):
        return ()
    found = (_EXCLUDED.fullmatch(guard) for guard in code)
    return tuple((int(m[1]), int(m[2]), int(m[3])) for m in found if m and int(m[3]) > 1)


def guards_accept(gm: fx.GraphModule, inputs: tuple[torch.Tensor, ...]) -> bool:
    """Whether the input guards torch.export put in ``gm`` (its ``GUARDS_MODULE``) accept ``inputs`` (meta tensors
    do: the guards read sizes only)."""
    guards = getattr(gm, GUARDS_MODULE, None)
    if guards is None:
        return True
    try:
        guards(*inputs)
    except (AssertionError, RuntimeError):  # torch._assert's failure
        return False
    return True


def at_backward_end(callback) -> None:
    """Run ``callback`` once the running backward pass has finished (called from within it: a gradient hook),
    as DDP and FSDP do to reduce gradients after their accumulation. Private: the autograd engine's
    ``queue_callback`` (checked on torch 2.13)."""
    engine = getattr(torch.autograd.Variable, "_execution_engine", None)
    queue = getattr(engine, "queue_callback", None)
    if queue is None:
        raise _changed("how a callback is queued at the end of a backward", "Variable._execution_engine.queue_callback")
    queue(callback)


def release_groups(mesh) -> None:
    """Drop the references a DeviceMesh (and its root) keeps to its process groups, so that a closed module's
    groups are freed while Python runs (a gloo group freed at interpreter exit aborts the process). Private:
    ``DeviceMesh._pg_registry`` and ``_root_mesh`` (checked on torch 2.13); a release without them keeps them."""
    for owner in (mesh, getattr(mesh, "_root_mesh", None)):
        registry = getattr(owner, "_pg_registry", None)
        if isinstance(registry, dict):
            registry.clear()


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
