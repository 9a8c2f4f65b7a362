"""torch's kernel tables with the capture's shape-only kernels put in while tracing: an op's Python composite
kernel (``OpOverload.py_kernels``, and the dispatch cache that remembers it) and fake tensors' ``view`` kernel
(``fake_impls.op_implementations_dict``). Held under ``CAPTURE_LOCK``; torch's own kernels put back after."""

from __future__ import annotations

import torch

from autotp.torch_private.entries import fenced
from autotp.torch_private.fake_internals import composite
from autotp.torch_private.replacements import locked

_REPLACED: dict = {}
"""Op -> the Python composite kernel torch had registered for it (matmul has one), while a stand-in replaces it."""

_TORCH_VIEW: list = []
"""torch's fake kernel for ``view`` while a stand-in replaces it (one element)."""


def torch_composite(op, *args, **kwargs):
    """``op`` computed as torch would: its own Python composite kernel if it had one, else its C++ one."""
    kernel = _REPLACED.get(op)
    return kernel(*args, **kwargs) if kernel is not None else composite(op, *args, **kwargs)


def torch_fake_view(fake_mode, func, a, *shape):
    """``view`` computed by torch's own fake kernel (the one a stand-in replaced)."""
    return _TORCH_VIEW[0](fake_mode, func, a, *shape)


@fenced("OpOverload.py_kernels[CompositeImplicitAutograd], OpOverload.py_impl and OpOverload._dispatch_cache; "
        "torch._subclasses.fake_impls.op_implementations_dict[aten.view.default]", replaces=True)
@locked
def composite_kernels_replaced(stand_ins: dict, view):
    """``stand_ins`` (op -> kernel) registered as the ops' Python composite kernels, and ``view`` as fake tensors'
    ``view`` kernel, while inside; torch's (where it had one in Python) restored after. Not reentrant: a nested use
    leaves the outer one's in place."""
    if _REPLACED or _TORCH_VIEW:
        yield
        return
    from torch._subclasses import fake_impls

    key = torch._C.DispatchKey.CompositeImplicitAutograd
    view_op = torch.ops.aten.view.default
    _TORCH_VIEW.append(fake_impls.op_implementations_dict[view_op])
    try:
        fake_impls.op_implementations_dict[view_op] = view
        for op, stand_in in stand_ins.items():
            _REPLACED[op] = op.py_kernels.pop(key, None)
            op.py_impl(key)(stand_in)
        yield
    finally:
        fake_impls.op_implementations_dict[view_op] = _TORCH_VIEW.pop()
        for op, kernel in _REPLACED.items():
            op.py_kernels.pop(key, None)
            if kernel is not None:
                op.py_kernels[key] = kernel
            op._dispatch_cache.clear()
        _REPLACED.clear()
