"""Models built without their weights: parameters on the meta device, never allocated; buffers real.

A layer makes its weight as ``Parameter(torch.empty(shape))`` and then initialises it in place; under
``empty_weights()`` that ``torch.empty`` makes a meta tensor, so a 256-expert layer costs nothing (moving
each parameter to meta after it was made, as accelerate's ``init_empty_weights`` does, asked for 30 GB).
Buffers computed at construction (rotary ``inv_freq``, causal masks), which checkpoints do not hold, keep
their values: they are made by ``ones``, ``arange`` and the like, which stay real. A buffer registered from
``torch.empty`` gets a real tensor (zeros); one filled before it was registered cannot be, and is
refused by name.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from autotp.errors import InputError

_EMPTY = {torch.empty, torch.Tensor.new_empty, torch.empty_strided}
"""The allocations that hold no values: only what is computed into them afterwards, on meta, is lost."""


class _EmptyOnMeta(TorchFunctionMode):
    """``torch.empty`` (and ``new_empty``, ``empty_strided``) on the meta device; remembers which tensors it made
    and which of those an in-place op then wrote."""

    def __init__(self):
        super().__init__()
        self.made: dict[int, torch.Tensor] = {}
        self.written: set[int] = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func in _EMPTY:
            kwargs["device"] = torch.device("meta")
            out = func(*args, **kwargs)
            self.made[id(out)] = out  # kept alive, so the id stays this tensor's
            return out
        name = getattr(func, "__name__", "")
        if name.endswith("_") and not name.endswith("__") and args and id(args[0]) in self.made:
            self.written.add(id(args[0]))
        return func(*args, **kwargs)


@contextlib.contextmanager
def empty_weights():
    """Build models with their parameters on the meta device and their buffers real (accelerate's
    ``init_empty_weights()``, without the dependency): ``with autotp.empty_weights(): model = Model(config)``.

    Parameters made by ``torch.empty`` (every torch layer's, Hugging Face's experts) are never allocated; others
    (``torch.ones(...)`` norms, ``torch.randn(...) * 0.02``) are moved to meta as they are registered, one at a
    time. Buffers keep their values; tied parameters stay tied.
    """
    register, register_buffer = nn.Module.register_parameter, nn.Module.register_buffer
    mode = _EmptyOnMeta()

    def on_meta(module: nn.Module, name: str, param) -> None:
        register(module, name, param)
        if param is not None and not param.is_meta:  # a meta one is a tie, or made on meta already
            module._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    def real_buffer(module: nn.Module, name: str, tensor, persistent: bool = True) -> None:
        if tensor is not None and id(tensor) in mode.made:
            if id(tensor) in mode.written:
                raise InputError(f"buffer {type(module).__name__}.{name} was made with torch.empty and filled before "
                                 "it was registered; under autotp.empty_weights() torch.empty makes meta tensors (so "
                                 "weights are never allocated): make the buffer with torch.zeros, or register it "
                                 "before filling it")
            # Real, as torch.empty would have made it (zeros: torch.empty itself is on meta in here).
            tensor = torch.zeros(tensor.shape, dtype=tensor.dtype)
        register_buffer(module, name, tensor, persistent)

    nn.Module.register_parameter, nn.Module.register_buffer = on_meta, real_buffer
    try:
        with mode:
            yield
    finally:
        nn.Module.register_parameter, nn.Module.register_buffer = register, register_buffer
