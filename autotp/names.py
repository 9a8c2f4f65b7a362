"""Module and parameter names: which module a name lies in, and the repeated block it belongs to.

Plans, reports, pictures and exports all speak of the original model's dotted names; these helpers
are the one place that knows how such names nest and how block numbers appear in them.
"""

from __future__ import annotations

import re

BLOCK_INDEX = re.compile(r"\.(\d+)(?=\.|$)")
"""A block number inside a dotted name (``.3`` in ``transformer.h.3.attn``)."""


def within(name: str, module: str) -> bool:
    """Whether ``name`` is ``module`` or lies inside it (``''`` is the whole model)."""
    return not module or name == module or name.startswith(module + ".")


def within_any(name: str, modules) -> bool:
    """Whether ``name`` lies in any of ``modules``."""
    return any(within(name, m) for m in modules)


def block_of(name: str) -> str:
    """The repeated block a name lives in (``transformer.h.3.attn.c_attn`` -> ``transformer.h.3``), else ''."""
    m = BLOCK_INDEX.search(name)
    return name[:m.end()] if m else ""


def block_pattern(name: str, placeholder: str = "*") -> str:
    """``name`` with every block number replaced by ``placeholder`` (``layers.*.mlp``)."""
    return BLOCK_INDEX.sub(lambda _: "." + placeholder, name)


def block_numbers(name: str) -> tuple[int, ...]:
    """The block numbers in ``name``, outermost first."""
    return tuple(int(i) for i in BLOCK_INDEX.findall(name))
