"""Why a capture failed on a forward that writes into a parameter's ``.data``.

Some forwards change their own weights outside autograd while training (Gemma 3n's AltUp clamps its coefficient
matrix in place, ``self.prediction_coefs.weight.data.clamp_(...)``, each training step): an update no captured
graph can express, which torch.export reports only as "a fake tensor in the exported program constant's list".
``weight_write`` finds the write by running the forward once more, eagerly, stopped just before it (nothing of the
model changes: the write is not made, buffers and random generators are restored), and names the parameter and
the model's line.
"""

from __future__ import annotations

import os
import traceback

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

FAKE_CONSTANT = "fake tensor in the exported program constant"
"""The words of torch.export's error for a tensor made outside the trace, as ``.data`` of a parameter is."""


class _Stop(Exception):
    """Raised at the write, so the forward stops before making it."""


class _WatchData(TorchFunctionMode):
    """Records each ``parameter.data`` read, and stops at the first in-place op on one (its name and the line)."""

    def __init__(self, names: dict[int, str]):
        super().__init__()
        self.names, self.views = names, {}
        self.kept: list[torch.Tensor] = []  # the views read, alive while recorded (an id is not reused)
        self.found: tuple[str, str, str] | None = None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name.endswith("_") and not name.endswith("__") and args and id(args[0]) in self.views:
            self.found = (self.views[id(args[0])], name, _user_line())
            raise _Stop
        out = func(*args, **(kwargs or {}))
        if name == "__get__" and args and id(args[0]) in self.names and isinstance(out, torch.Tensor):
            self.views[id(out)] = self.names[id(args[0])]
            self.kept.append(out)
        return out


def _user_line() -> str:
    """The innermost frame outside torch and autotp: the model's line making the write."""
    skip = (os.path.dirname(torch.__file__), os.path.dirname(os.path.dirname(__file__)))
    frames = [f for f in traceback.extract_stack() if not f.filename.startswith(skip)]
    if not frames:
        return "inside torch"
    f = frames[-1]
    return f"{os.path.basename(f.filename)}:{f.lineno} `{(f.line or '').strip()}`"


def weight_write(model: nn.Module, call) -> str | None:
    """Where ``call()`` (the model's forward on the example) writes into a parameter's ``.data`` in place, in one
    line (the parameter, the op, the model's line); None if it does not. ``model`` is left as it was."""
    names = {id(p): n for n, p in model.named_parameters()}
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    watch = _WatchData(names)
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        try:
            with watch:
                call()
        except _Stop:
            pass
        except Exception:  # the forward failing for another reason: no write found
            return None
        finally:
            for buffer, saved in buffers:
                buffer.copy_(saved)
    if watch.found is None:
        return None
    name, op, line = watch.found
    return f"the forward changes parameter {name} in place outside autograd ({op} on its .data at {line})"
