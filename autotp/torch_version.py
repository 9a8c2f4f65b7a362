"""The torch releases autotp runs on, checked once where autotp first needs torch.

autotp's capture reads what torch gives (operator tags such as ``Tag.inplace``, ``torch.export``'s unlifting and
symbolic-shape internals, ``autotp.torch_private``); an older torch fails deep inside a capture with an
``AttributeError`` that names none of this. GPU images often ship an older torch than the CPU wheel this project
pins, so the first import says so instead. A newer torch than the tested ones is let through with one warning:
it may well work, but nothing has checked that its internals still read as autotp expects.
"""

from __future__ import annotations

import re
import warnings

from autotp.errors import UnsupportedTorchError, UntestedTorchWarning


def release(version: str) -> tuple[int, int]:
    """``(2, 13)`` for ``"2.13.0+cpu"`` or ``"2.14.0.dev20261101+cu130"``; ``(0, 0)`` for a version not so written."""
    match = re.match(r"(\d+)\.(\d+)", version)
    return (int(match[1]), int(match[2])) if match else (0, 0)


TESTED_TORCH = ("2.13.0", "2.14.1", "2.15.0")
"""The torch versions autotp's tests run on, oldest first: CI runs the whole suite on the first and the capture,
checker, generation and MoE tests on each later one (``.ci/run``). Add a release here only with a CI run on it."""
MINIMUM_TORCH = release(TESTED_TORCH[0])
"""The oldest torch release (major, minor) autotp is tested with: an older one is refused."""
NEWEST_TESTED_TORCH = release(TESTED_TORCH[-1])
"""The newest torch release (major, minor) autotp is tested with: a newer one is warned about, once."""
_WARNED: set[str] = set()
"""The untested torch versions already warned about in this process."""


def tested_range() -> str:
    """The tested releases as users write them: ``"2.13 to 2.14"``."""
    low, high = (".".join(map(str, r)) for r in (MINIMUM_TORCH, NEWEST_TESTED_TORCH))
    return low if low == high else f"{low} to {high}"


def require_supported_torch(version: str | None = None) -> None:
    """Raise ``UnsupportedTorchError`` when torch (or ``version``) is older than ``MINIMUM_TORCH``; warn once
    (``UntestedTorchWarning``, a ``UserWarning``) when it is newer than ``NEWEST_TESTED_TORCH``."""
    if version is None:
        import torch

        version = torch.__version__
    if release(version) < MINIMUM_TORCH:
        need = ".".join(map(str, MINIMUM_TORCH))
        raise UnsupportedTorchError(
            f"autotp needs torch >= {need}, found torch {version}: its capture reads operator tags and "
            f"torch.export internals that earlier releases lack; install a tested release, torch {tested_range()} "
            f"(pip install torch=={TESTED_TORCH[0]} on this project's CPU machines)")
    if release(version) > NEWEST_TESTED_TORCH and version not in _WARNED:
        _WARNED.add(version)
        warnings.warn(
            f"autotp is tested with torch {tested_range()}, found torch {version}: it may work, but a newer "
            f"release can change the torch internals autotp's capture reads (autotp/torch_private.py); "
            f"if a capture or a check fails, try torch {TESTED_TORCH[-1]} (pip install torch=={TESTED_TORCH[-1]})",
            UntestedTorchWarning, stacklevel=3)
