"""Trace a value the forward computes again from the same inputs once, the way a compiler merges common
subexpressions, but before the tracer pays for the copies.

Models recompute small values in every layer from values that need no gradient: DeBERTa's attention builds
its scale ``sqrt(torch.tensor(head_size) * factor)`` three times a layer and clamps and expands the same
relative positions into gather indices twice a layer, a third of its graph. Each traced op costs torch's
tracer about a millisecond whatever its size, so those copies made capturing DeBERTa cost twice what BERT's
does. While the forward is traced, ``computed_once`` hands back the tensor an earlier identical call made
(same function, the same tensor objects at the same versions, equal other arguments), so the graph holds
one node where the model ran the op once per layer.

Only what cannot change the result is shared:
- every tensor argument and the result need no gradient (so no gradient is summed in a new order);
- the function is a deterministic, functional torch op (an aten op of that name without the
  ``nondeterministic_seeded`` tag, or an operator such as ``+``); random draws (by the tag, or by a name that says
  so: ``_DRAWS``), in-place ops, ``out=`` and uninitialised tensors (``empty``) never are;
- the autocast state of every device type (enabled, and to which dtype) and the default dtype are part of the
  key (``torch.is_autocast_enabled()`` alone reports CUDA's only: a product under CPU autocast is another value);
- a result that has come to need a gradient (``requires_grad_()``, which bumps no version) is not handed out.
A model that writes in place into a value after it was shared (both copies would see the write) is detected
(the tensor's version counter, shared with its views, or an in-place call on it), and the capture is then
traced again without sharing (``shared_value_written``). ``.data`` does not share the version counter, so once
the forward takes a tensor's ``.data``, nothing more is shared.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch.overrides import TorchFunctionMode

from autotp.torch_private import is_op_packet, tensor_data
from autotp.capture.quirks.weight_writes import writes_in_place

_OPERATORS = frozenset({
    "__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__", "__truediv__", "__rtruediv__",
    "__div__", "__rdiv__", "__floordiv__", "__rfloordiv__", "__mod__", "__rmod__", "__pow__", "__rpow__",
    "__matmul__", "__rmatmul__",
    "__neg__", "__abs__", "__invert__", "__and__", "__rand__", "__or__", "__ror__", "__xor__", "__rxor__",
    "__eq__", "__ne__", "__lt__", "__le__", "__gt__", "__ge__", "__getitem__", "__lshift__", "__rshift__"})
"""Tensor operators that compute a new value (the in-place ones, ``__iadd__`` and ``__setitem__``, are not)."""

_CASTS = frozenset({"float", "double", "half", "bfloat16", "long", "int", "short", "bool", "byte", "char",
                    "type_as"})
"""Tensor methods that are casts, with no aten op of their name."""


_DRAWS = ("rand", "dropout", "fractional", "gumbel", "normal", "bernoulli", "multinomial", "poisson", "uniform",
          "exponential", "cauchy", "geometric", "sample", "noise", "rrelu")
"""Words in the names of functions that draw random numbers. A Python function may draw before calling an aten op
that takes the draw as an argument (``fractional_max_pool2d`` makes its samples with ``torch.rand``), so that op's
tags say nothing of the draw: these names are never shared, whatever the tags."""


@functools.cache
def _deterministic_op(func) -> bool:
    """Whether ``func`` computes a new tensor deterministically from its arguments."""
    name = getattr(func, "__name__", "")
    if name in _OPERATORS or name in _CASTS:
        return True
    if not name or name.startswith("_") or name.endswith("_") or "empty" in name or \
            any(word in name for word in _DRAWS):
        return False
    packet = getattr(torch.ops.aten, name, None)
    if not is_op_packet(packet):
        return False
    return not any(torch.Tag.nondeterministic_seeded in getattr(packet, o).tags for o in packet.overloads())


class _NotShared(Exception):
    """An argument that keeps the call from being shared: a tensor that needs a gradient, or an object of a type
    the key cannot hold by value."""


def _argument_key(value, tensors: list):
    """A hashable stand-in for one argument; tensors (appended to ``tensors``) by identity and version."""
    if isinstance(value, torch.Tensor):
        if value.requires_grad or value.is_inference():  # an inference tensor has no version counter
            raise _NotShared
        tensors.append(value)
        return ("tensor", id(value), value._version)
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return (type(value).__name__, str(value))  # the expression: equal expressions print alike
    if isinstance(value, float):
        # -0.0 and 0.0 differ in sign, and nan is not equal to itself; float's own repr, as a block's tracked rate
        # (``block_floats``) would take its repr for a decision on its value
        return ("float", float.__repr__(value))
    if value is None or value is Ellipsis or isinstance(value, (bool, int, str, torch.dtype, torch.device,
                                                               torch.layout, torch.memory_format)):
        return (type(value).__name__, value)
    if isinstance(value, slice):
        return ("slice", *(_argument_key(v, tensors) for v in (value.start, value.stop, value.step)))
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, *(_argument_key(v, tensors) for v in value))
    raise _NotShared


AUTOCAST_DEVICES = ("cpu", "cuda")


def _autocast_state() -> tuple:
    """Which device types autocast is on for, and to which dtype: a call under autocast computes another value."""
    return tuple((d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in AUTOCAST_DEVICES)


@dataclass
class _Shared:
    """A result handed out again: the argument tensors it was made from are kept alive, so no other tensor
    takes their ids while the key names them."""

    result: torch.Tensor
    version: int
    arguments: list


class computed_once(TorchFunctionMode):
    """While open, an identical repeated call of a deterministic op on tensors that need no gradient returns
    the earlier result (see the module's docstring); ``shared_value_written`` says afterwards whether the
    model wrote into a value that was handed out twice."""

    def __init__(self):
        """An empty table of results; sharing is on until a tensor's ``.data`` is taken."""
        super().__init__()
        self.results: dict[tuple, _Shared] = {}
        self.handed_again: dict[int, _Shared] = {}  # id(result) -> its entry, for results handed out twice
        self.written = False
        self.off = False  # once a tensor's .data is taken

    def __torch_function__(self, func, types, args=(), kwargs=None):
        """Run ``func``, or hand back the result an identical earlier call made (see the class's docstring)."""
        kwargs = kwargs or {}
        if getattr(func, "__self__", None) is tensor_data():
            self.off = True  # .data shares no version counter: a write through it would go unseen from here on
        key, tensors = self._key(func, args, kwargs) if not self.off else (None, [])
        if key is None:
            self._note_writes(func, args)
            return func(*args, **kwargs)
        earlier = self.results.get(key)
        if earlier is not None and earlier.result._version == earlier.version and not earlier.result.requires_grad:
            self.handed_again[id(earlier.result)] = earlier
            return earlier.result
        result = func(*args, **kwargs)
        if isinstance(result, torch.Tensor) and not result.requires_grad and not result.is_inference():
            self.results[key] = _Shared(result, result._version, tensors)
        return result

    def _key(self, func, args, kwargs) -> tuple[tuple | None, list]:
        """The call's key, or None when it may not be shared."""
        try:
            if "out" in kwargs or not _deterministic_op(func):
                return None, []
        except TypeError:  # a function that cannot be hashed: never shared
            return None, []
        tensors: list[torch.Tensor] = []
        try:
            key = (func, _argument_key(args, tensors), _argument_key(tuple(sorted(kwargs.items())), tensors),
                   _autocast_state(), torch.get_default_dtype())
        except _NotShared:
            return None, []
        return key, tensors

    def _note_writes(self, func, args) -> None:
        """Mark an in-place call (or a change of a tensor's metadata in place) on a shared result."""
        if writes_in_place(func) and args and isinstance(args[0], torch.Tensor):
            shared = self.handed_again.get(id(args[0]))
            self.written |= shared is not None and shared.result is args[0]

    def shared_value_written(self) -> bool:
        """Whether the forward wrote into a result after it was handed out a second time."""
        return self.written or any(s.result._version != s.version for s in self.handed_again.values())
