"""Private torch reads about captured graphs and their values: symbolic sizes, op schemas, op types, the exported
module's output spec and input guards, the ``.data`` property and grad-mode op the graphs hold.

Nothing here is read at import time: each torch object is looked up when first asked for.
"""

from __future__ import annotations

import functools
import re

import sympy
import torch
from torch import fx

from autotp.torch_private.entries import EVERY_RELEASE, FIRST_RELEASE, constant, fenced
from autotp.errors import InternalError


def changed(what: str, detail: str) -> InternalError:
    """The error a fenced entry raises when a torch release no longer has what it relies on."""
    return InternalError(f"torch {torch.__version__} changed {what} ({detail}); autotp needs updating for it")


@fenced("torch._C.TensorBase.data, the .data property whose getter and setter reach a TorchFunctionMode")
@functools.cache
def tensor_data():
    """The ``.data`` property of tensors (its getter and setter reach a TorchFunctionMode as methods of it)."""
    return torch._C.TensorBase.data


@fenced("SymInt.node.expr / SymBool.node.expr, the sympy expression behind a symbolic value")
def symbolic_expr(value) -> sympy.Basic:
    """The sympy expression behind a ``SymInt``, ``SymFloat`` or ``SymBool``."""
    expr = getattr(getattr(value, "node", None), "expr", None)  # private: Sym*.node.expr
    if not isinstance(expr, sympy.Basic):
        raise changed("how symbolic values expose their expression", f"{type(value).__name__}.node.expr")
    return expr


def size_expr(size) -> int | sympy.Expr:
    """A tensor size as an int, or as the sympy expression of a symbolic size (``s70*s72``)."""
    if isinstance(size, int):
        return int(size)
    expr = symbolic_expr(size)
    if not isinstance(expr, sympy.Expr):
        raise changed("how symbolic sizes expose their expression", f"{type(size).__name__}.node.expr")
    return int(expr) if expr.is_Integer else expr


@fenced("SymInt.node.hint, the example's value of a backed symbolic size (None for a data-dependent one)")
def size_hint(size) -> int | None:
    """A size's value in the example (a symbolic size's hint), or None where it has none (data-dependent)."""
    if isinstance(size, int):
        return size
    node = getattr(size, "node", None)
    if node is None or not hasattr(node, "hint"):
        raise changed("how symbolic sizes expose their example value", f"{type(size).__name__}.node.hint")
    return node.hint


def plain_sizes(value: torch.Tensor) -> tuple:
    """The sizes of an example tensor as ints and sympy expressions."""
    return tuple(size_expr(d) for d in value.shape)


@fenced("OpOverload._schema, its arguments' alias annotations (which an op writes in place)")
def op_schema(target):
    """The schema of an aten op (``OpOverload._schema``), or None for any other call target."""
    return getattr(target, "_schema", None) if is_op_overload(target) else None


def mutated_args(node: fx.Node) -> tuple:
    """The argument paths (``(i,)`` or ``("kw", name)``) that ``node``'s op writes to in place."""
    schema = getattr(node.target, "_schema", None)  # private: OpOverload._schema (``op_schema``'s entry)
    if schema is None:
        return ()
    paths = []
    for i, arg in enumerate(schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            paths.append((i,) if i < len(node.args) else ("kw", arg.name))
    return tuple(paths)


@fenced("torch._ops.OpOverload, the class of an aten op's overload (aten.add.Tensor)")
def is_op_overload(target) -> bool:
    """Whether ``target`` is one overload of an op (``aten.add.Tensor``)."""
    return isinstance(target, torch._ops.OpOverload)


@fenced("OpOverload._overloadpacket, the op an overload belongs to")
def overload_packet(target):
    """The op (``aten.add``) an overload (``aten.add.Tensor``) belongs to."""
    return target._overloadpacket


@fenced("torch._ops.OpOverloadPacket, the class of an op with all its overloads (aten.add)")
def is_op_packet(target) -> bool:
    """Whether ``target`` is an op with all its overloads (``aten.add``)."""
    return isinstance(target, torch._ops.OpOverloadPacket)


@fenced("torch._ops.HigherOrderOperator, the class of export's wrapping ops (wrap_with_set_grad_enabled)")
def is_higher_order_op(target) -> bool:
    """Whether ``target`` is a higher-order op (one that calls a submodule)."""
    return isinstance(target, torch._ops.HigherOrderOperator)


@fenced("torch._C._set_grad_enabled, the call pre-dispatch graphs switch gradients with")
def set_grad_enabled_op():
    """The function graphs call to switch gradients on or off (``torch._C._set_grad_enabled``)."""
    return torch._C._set_grad_enabled


@fenced("torch._check, a condition the shape environment learns (a runtime assertion in a traced graph)")
def check(condition, message) -> None:
    """``torch._check``: assert ``condition`` (a symbolic one becomes a fact of the trace, or its assertion)."""
    torch._check(condition, message)


@fenced("GraphModule._out_spec, which ExportedProgram.module() sets")
def output_spec(module: fx.GraphModule):
    """The pytree spec of an exported module's outputs (to rebuild them from a flat list)."""
    spec = getattr(module, "_out_spec", None)  # private: set by ExportedProgram.module()
    if spec is None:
        raise changed("where an exported module keeps its output spec", "GraphModule._out_spec")
    return spec


GUARDS_MODULE = "_guards_fn"
"""The submodule torch.export adds to check input shapes; it belongs to the whole model, not to a stage."""
constant("GUARDS_MODULE", "the name of the input-guard submodule ExportedProgram.module() adds (_guards_fn)")


def is_guard_call(node: fx.Node) -> bool:
    """Whether ``node`` calls the export's input-shape guard module (``GUARDS_MODULE``)."""
    return node.op == "call_module" and node.target == GUARDS_MODULE


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


_EXCLUDED = re.compile(r"L\['inputs'\]\[(\d+)\]\.size\(\)\[(\d+)\] != (\d+)")
"""An input guard excluding one size of one input: ``L['inputs'][0].size()[1] != 16`` (the capture wrapper takes its
inputs as ``*inputs``)."""


@fenced("ExportedProgram._guards_code, the input guards as code; a release without it finds none (and "
        "tests/test_sequence_full_context.py fails)", FIRST_RELEASE)
def excluded_sizes(program: torch.export.ExportedProgram) -> tuple[tuple[int, int, int], ...]:
    """``(input, dim, size)`` for each input guard of an exported program that excludes one size above 1 (sizes 0
    and 1 are excluded from every dynamic size anyway): a layout probe's guard at an example shorter than a table,
    ``L['inputs'][0].size()[1] != 16``."""
    code = getattr(program, "_guards_code", None)
    if not isinstance(code, list):
        return ()
    found = (_EXCLUDED.fullmatch(guard) for guard in code)
    return tuple((int(m[1]), int(m[2]), int(m[3])) for m in found if m and int(m[3]) > 1)


@fenced("Distribution._validate_args, torch.distributions' validation default (set_default_validate_args is "
        "its public setter)", EVERY_RELEASE)
def distribution_validation() -> bool:
    """torch.distributions' default for validating a distribution's arguments."""
    value = getattr(torch.distributions.Distribution, "_validate_args", None)
    if not isinstance(value, bool):
        raise changed("where distributions keep their validation default", "Distribution._validate_args")
    return value
