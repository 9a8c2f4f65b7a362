"""The torch releases autotp runs on, checked once where autotp first needs torch.

autotp's capture reads what torch 2.13 gives (operator tags such as ``Tag.inplace``, ``torch.export``'s
unlifting and symbolic-shape internals, ``capture.torch_private``); an older torch fails deep inside a
capture with an ``AttributeError`` that names none of this. GPU images often ship an older torch than
the CPU wheel this project pins, so the first import says so instead.
"""

from __future__ import annotations

import re

from autotp.errors import UnsupportedTorchError

MINIMUM_TORCH = (2, 13)
"""The oldest torch release (major, minor) autotp is tested with."""


def release(version: str) -> tuple[int, int]:
    """``(2, 13)`` for ``"2.13.0+cpu"`` or ``"2.14.0.dev20261101+cu130"``; ``(0, 0)`` for a version not so written."""
    match = re.match(r"(\d+)\.(\d+)", version)
    return (int(match[1]), int(match[2])) if match else (0, 0)


def require_supported_torch(version: str | None = None) -> None:
    """Raise ``UnsupportedTorchError`` when torch (or ``version``) is older than ``MINIMUM_TORCH``."""
    if version is None:
        import torch

        version = torch.__version__
    if release(version) < MINIMUM_TORCH:
        need = ".".join(map(str, MINIMUM_TORCH))
        raise UnsupportedTorchError(
            f"autotp needs torch >= {need}, found torch {version}: its capture reads operator tags and "
            f"torch.export internals that earlier releases lack; install torch {need} or newer "
            f"(pip install torch=={need}.0 on this project's CPU machines)")
