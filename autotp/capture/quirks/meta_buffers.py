"""Capturing a model whose parameters are on the meta device and whose buffers are real.

Such a model (built under ``autotp.empty_weights()`` or accelerate's ``init_empty_weights()``, its weights to
come from a checkpoint) mixes devices inside one op as soon as a parameter-derived value meets a buffer
(nanoGPT's ``att.masked_fill(self.bias[:, :, :T, :T] == 0, -inf)``), which torch refuses ("Tensor on device
meta is not on the expected device cpu"). The capture only needs shapes, so for its duration the buffers are
meta copies too; the model's own buffers are put back afterwards, and into the captured graph in place of the
copies (the rank modules take their values from it).
"""

from __future__ import annotations

import contextlib

from torch import nn


@contextlib.contextmanager
def buffers_on_meta(model: nn.Module):
    """For the body, every real buffer of ``model`` replaced by a meta copy when any parameter is on meta (a
    model with real parameters is left as it is); the originals restored afterwards, even on error. Yields
    the copies' ids -> the originals, for ``put_back``."""
    if not any(p.is_meta for p in model.parameters()):
        yield {}
        return
    swapped = []
    for module in model.modules():
        for name, buffer in module._buffers.items():
            if buffer is not None and not buffer.is_meta:
                swapped.append((module, name, buffer))
    copies = {}
    for module, name, buffer in swapped:
        module._buffers[name] = copy = buffer.to("meta")
        copies[id(copy)] = (copy, buffer)  # the copy kept alive, so its id stays its own
    try:
        yield copies
    finally:
        for module, name, buffer in swapped:
            module._buffers[name] = buffer


def put_back(gm: nn.Module, copies: dict) -> None:
    """Each meta copy ``buffers_on_meta`` lent the capture replaced, in the captured module, by its original."""
    if not copies:
        return
    for name, buffer in list(gm.named_buffers(remove_duplicate=False)):
        if id(buffer) in copies:
            owner, _, attr = name.rpartition(".")
            (gm.get_submodule(owner) if owner else gm)._buffers[attr] = copies[id(buffer)][1]
