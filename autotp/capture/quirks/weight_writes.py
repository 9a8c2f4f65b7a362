"""Forwards that write into a parameter's ``.data``: captured as no-grad writes, or said why not.

Some forwards change their own weights outside autograd while training (Gemma 3n's AltUp clamps its coefficient
matrix in place, ``self.prediction_coefs.weight.data.clamp_(...)``, each training step). torch.export cannot trace
``.data`` (its result is a tensor made outside the trace, reported as "a fake tensor in the exported program
constant's list"), but it traces what ``.data`` means: a view of the parameter that autograd does not see.
``data_as_no_grad`` (open while the forward is traced) reads ``parameter.data`` as ``parameter.detach()`` and
makes an in-place op on that view on the parameter itself under ``torch.no_grad()``: the graph then writes the
parameter in place without gradient, as the model does, and the ops after it read the written value (the
parameter, a leaf, still gets the whole gradient). Run on a rank's shard, an elementwise write is the whole
write's shard.

Only writes of the whole ``.data`` that give the same weights when repeated are captured (``REPEATABLE_WRITES``:
clamps, fills); any other (a write into a part, ``p.data[0].zero_()`` or ``p.data[:2] = 0``, which on a rank holding a shard is not
the model's part; ``mul_``, which a pipeline's microbatches would repeat; ``p.data = value``) is refused, naming
the model's line.
"""

from __future__ import annotations

import os
import traceback

import torch
from torch import fx
from torch.overrides import TorchFunctionMode

from autotp.torch_private import mutated_args, tensor_data
from autotp.errors import CaptureError


def _on_data(func, args, method: str) -> bool:
    """Whether ``func(*args)`` is ``method`` (``__get__``, ``__set__``) of ``.data`` on a parameter (a leaf that
    requires grad)."""
    return getattr(func, "__self__", None) is tensor_data() and getattr(func, "__name__", "") == method and bool(args) \
        and isinstance(args[0], torch.Tensor) and args[0].is_leaf and args[0].requires_grad


def writes_in_place(func) -> bool:
    """Whether a torch function writes its first argument in place: an in-place method (``add_``; ``+=`` reaches a
    mode as one) or an indexed assignment (``x[...] = y``, which reaches it as ``__setitem__``)."""
    name = getattr(func, "__name__", "")
    return name == "__setitem__" or (name.endswith("_") and not name.endswith("__"))


def _written_with(func) -> str:
    """How a refusal names the write."""
    return "an indexed assignment (p.data[...] = ...)" if func.__name__ == "__setitem__" else func.__name__


REPEATABLE_WRITES = frozenset({"clamp_", "clamp_min_", "clamp_max_", "fill_", "zero_"})
"""In-place ops that give the same weights when repeated, with plain-number arguments: the only ``.data`` writes
captured. A pipeline stage runs the forward once per microbatch and a recomputed block runs its part again, where
the model runs it once a step: a clamp of clamped weights changes nothing, a second ``mul_(0.99)`` would."""


class data_as_no_grad(TorchFunctionMode):
    """While open: ``p.data`` of a parameter (a leaf that requires grad) is ``p.detach()``, and a repeatable
    in-place op on that view (``REPEATABLE_WRITES``) is made on ``p`` under ``torch.no_grad()`` (see the module's
    docstring); any other write into ``p.data`` is refused. Other tensors' ``.data`` is torch's."""

    def __init__(self):
        super().__init__()
        self.owners: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(view) -> (view, parameter)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _on_data(func, args, "__get__"):
            view = args[0].detach()
            self.owners[id(view)] = (view, args[0])  # the view is kept alive here, so its id is not reused
            return view
        if _on_data(func, args, "__set__"):
            if _same_tensor(args[1], args[0]):
                return None  # p.data = p: Module.to(dtype) of a module already in that dtype (Switch's router)
            raise CaptureError(_refusal("replaces a parameter's .data (p.data = ...)"))
        if args and isinstance(args[0], torch.Tensor) and writes_in_place(func):
            owner = self.owners.get(id(args[0]))
            if owner is not None and owner[0] is args[0]:
                if func.__name__ not in REPEATABLE_WRITES or _any_tensor(args[1:], kwargs):
                    raise CaptureError(_refusal(f"writes a parameter's .data with {_written_with(func)}"))
                with torch.no_grad():
                    func(owner[1], *args[1:], **kwargs)
                return owner[0]
            self._refuse_partial_write(func, args[0])
        return func(*args, **kwargs)

    def _refuse_partial_write(self, func, target: torch.Tensor) -> None:
        """Raise if ``target`` shares a ``.data`` view's storage without being it or its parameter."""
        storage = target.untyped_storage()._cdata
        for view, parameter in self.owners.values():
            if target is not parameter and view.untyped_storage()._cdata == storage:
                raise CaptureError(_refusal(f"writes into a part of a parameter's .data ({_written_with(func)})"))


def _same_tensor(value, parameter: torch.Tensor) -> bool:
    """Whether ``value`` is ``parameter`` itself, or a view of all of it as it is (same storage and layout)."""
    if value is parameter:
        return True
    return isinstance(value, torch.Tensor) and value.untyped_storage()._cdata == \
        parameter.untyped_storage()._cdata and value.dtype == parameter.dtype and \
        value.shape == parameter.shape and value.stride() == parameter.stride() and \
        value.storage_offset() == parameter.storage_offset()


def _any_tensor(args, kwargs) -> bool:
    return any(isinstance(a, torch.Tensor) for a in (*args, *kwargs.values()))


def _refusal(what: str) -> str:
    """Why a write into a parameter's ``.data`` is not captured, with the model's line and what to do."""
    return (f"the forward {what} at {_user_line()}: autotp captures only writes of the whole .data that give the "
            f"same weights when repeated ({', '.join(sorted(REPEATABLE_WRITES))} by plain numbers): a rank holds a "
            "shard, and a pipeline stage or a recomputed block runs the forward more than once a step. Make the "
            "update a step after the optimizer's, or capture the model in eval mode for inference")


def parameter_writes(gm: fx.GraphModule) -> list[tuple[fx.Node, fx.Node]]:
    """(the op, the parameter's ``get_attr``) for every op of ``gm``'s graph that writes a parameter in place."""
    return [(node, node.args[0]) for node in gm.graph.nodes
            if node.op == "call_function" and (0,) in mutated_args(node) and isinstance(node.args[0], fx.Node) and node.args[0].op == "get_attr"
            and _is_parameter(gm, node.args[0].target)]


def _is_parameter(gm: fx.GraphModule, target: str) -> bool:
    owner, _, name = target.rpartition(".")
    return name in gm.get_submodule(owner)._parameters


def written_parameters(gm: fx.GraphModule) -> list[torch.Tensor]:
    """The parameters of ``gm`` an op of its graph writes in place (``data_as_no_grad``'s writes)."""
    out: list[torch.Tensor] = []
    for _, target in parameter_writes(gm):
        value = gm.get_parameter(target.target)
        if all(value is not seen for seen in out):
            out.append(value)
    return out


def read_parameters_past_writes(gm: fx.GraphModule) -> int:
    """Make the ops after an in-place write to a parameter read the parameter's ``get_attr``, not the write's
    output (the same tensor: an in-place op returns its input), so a projection reading the written weight is
    seen as one; the write stays where it was, before them (an op that writes is never dropped as dead code).
    Returns how many writes were."""
    writes = parameter_writes(gm)
    for node, target in writes:
        node.replace_all_uses_with(target)
    if writes:
        gm.recompile()
    return len(writes)


def _user_line() -> str:
    """The innermost frame outside torch and autotp: the model's line making the write."""
    skip = (os.path.dirname(torch.__file__), os.path.dirname(os.path.dirname(__file__)))
    frames = [f for f in traceback.extract_stack() if not f.filename.startswith(skip)]
    if not frames:
        return "inside torch"
    f = frames[-1]
    return f"{os.path.basename(f.filename)}:{f.lineno} `{(f.line or '').strip()}`"
