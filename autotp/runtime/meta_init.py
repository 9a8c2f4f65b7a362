"""Models built without their weights: parameters on the meta device, never allocated; buffers real.

A layer makes its weight as ``Parameter(torch.empty(shape))`` and then initialises it in place; under
``empty_weights()`` that ``torch.empty`` makes a meta tensor, so a 256-expert layer costs nothing (moving
each parameter to meta after it was made, as accelerate's ``init_empty_weights`` does, asked for 30 GB).
Buffers computed at construction (rotary ``inv_freq``, causal masks), which checkpoints do not hold, keep
their values: they are made by ``ones``, ``arange`` and the like, which stay real. A buffer registered from
``torch.empty`` gets a real tensor (zeros); one filled before it was registered cannot be, and is
refused by name.

Weights made with values (``nn.Parameter(torch.randn(E, D, F) * 0.02)``, ``torch.ones(d)``) cannot be told
from buffers when they are made. Small ones are made real and moved to meta as they are registered (a norm's
weight costs nothing); one of ``_LARGE`` elements or more is made on meta at once, as its allocation could
exhaust the host, and remade real (the same call again) if it turns out to be a buffer. A buffer *computed*
from such a tensor has no values to keep, and is refused by name.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from autotp.errors import InputError

_EMPTY = {torch.empty, torch.Tensor.new_empty, torch.empty_strided}
"""The allocations that hold no values: only what is computed into them afterwards, on meta, is lost."""
_FILLED = {torch.randn, torch.rand, torch.ones, torch.zeros, torch.full}
"""Allocations with values, made on meta when they are large (a weight), remade real if registered as buffers."""
_LARGE = 2 ** 27
"""Elements from which a filled allocation is made on meta: 512 MiB of float32. Below it, a tensor is made
real (briefly: a parameter moves to meta when registered), so that buffers computed from small ones (a
causal mask ``tril(ones(T, T))`` up to T = 11585) keep their values."""


class _EmptyOnMeta(TorchFunctionMode):
    """``torch.empty`` (and ``new_empty``, ``empty_strided``) on the meta device; remembers which tensors it made
    and which of those an in-place op then wrote."""

    def __init__(self):
        super().__init__()
        self.made: dict[int, torch.Tensor] = {}
        self.written: set[int] = set()
        self.large: dict[int, tuple] = {}
        """Large filled tensors made on meta: id -> (the tensor, kept alive; the call that remakes it real)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func in _EMPTY:
            kwargs["device"] = torch.device("meta")
            out = func(*args, **kwargs)
            self.made[id(out)] = out  # kept alive, so the id stays this tensor's
            return out
        if func in _FILLED and kwargs.get("device") is None:
            shaped = func(*args, **kwargs, device="meta")  # its shape, for nothing
            if shaped.numel() >= _LARGE:
                # Remade on the default device named outright: a call naming its device passes through this mode.
                self.large[id(shaped)] = (shaped, lambda: func(*args, **kwargs, device=torch.get_default_device()))
                return shaped
        name = getattr(func, "__name__", "")
        if name.endswith("_") and not name.endswith("__") and args and id(args[0]) in self.made:
            self.written.add(id(args[0]))
        return func(*args, **kwargs)


@contextlib.contextmanager
def empty_weights():
    """Build models with their parameters on the meta device and their buffers real (accelerate's
    ``init_empty_weights()``, without the dependency): ``with autotp.empty_weights(): model = Model(config)``.

    Parameters made by ``torch.empty`` (every torch layer's, Hugging Face's experts) or by ``randn``, ``rand``,
    ``ones``, ``zeros`` or ``full`` with 2**27 elements or more are never allocated; smaller ones (``torch.ones(d)``
    norms) are moved to meta as they are registered, one at a time. Buffers keep their values; tied parameters
    stay tied.
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
        elif tensor is not None and id(tensor) in mode.large:
            tensor = mode.large[id(tensor)][1]()  # the same call, real: a large buffer made by ones(...) and such
        elif tensor is not None and tensor.is_meta and mode.large:  # likely computed from one made on meta here
            raise InputError(f"buffer {type(module).__name__}.{name} {tuple(tensor.shape)} is on meta: computed from a tensor "
                             f"of {_LARGE} elements or more, which autotp.empty_weights() makes on the meta device "
                             "(it cannot tell a weight from a buffer when it is made): build the buffer from smaller "
                             "pieces, or register it from a real tensor made outside the empty_weights() block")
        register_buffer(module, name, tensor, persistent)

    nn.Module.register_parameter, nn.Module.register_buffer = on_meta, real_buffer
    try:
        with mode:
            yield
    finally:
        nn.Module.register_parameter, nn.Module.register_buffer = register, register_buffer
