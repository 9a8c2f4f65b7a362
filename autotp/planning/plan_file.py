"""Every field of a plan file checked for its type and range before a ``Plan`` is built from it.

A plan file may be hand-edited or written by someone else: ``dim: 0.0``, ``dim: "0"``, a negative segment or a
collective's shape that is a Python expression must each be refused with one line naming the field and what
to write instead, never a ``TypeError`` from deep inside, and nothing in the file is evaluated (sizes are read
by ``shape_expr.parse_size``).
"""

from __future__ import annotations

import math
from enum import Enum

from autotp.errors import InputError
from autotp.options import Balance, DataParallelMode, Options, Recompute, Schedule
from autotp.passes.placement import PlacementKind
from autotp.passes.region_match import RegionKind
from autotp.passes.steps import CollectiveOp, Direction, Operator
from autotp.planning.shape_expr import ShapeSyntaxError, parse_size


class _Bad(Exception):
    """One field's problem: ``where`` (a path such as ``placements['w'].dim``) and ``what`` to write instead."""

    def __init__(self, where: str, what: str):
        super().__init__(where, what)
        self.where, self.what = where, what


def _describe(value) -> str:
    return f"{value!r} ({type(value).__name__})"


def _int(where: str, value, least: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise _Bad(where, f"must be a whole number, got {_describe(value)}")
    if value < least:
        raise _Bad(where, f"must be at least {least}, got {value}")
    return value


def _number(where: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise _Bad(where, f"must be a finite non-negative number, got {_describe(value)}")


def _bool(where: str, value) -> None:
    if not isinstance(value, bool):
        raise _Bad(where, f"must be true or false, got {_describe(value)}")


def _str(where: str, value) -> None:
    if not isinstance(value, str):
        raise _Bad(where, f"must be a string, got {_describe(value)}")


def _choice(where: str, value, enum: type[Enum]) -> None:
    allowed = [m.value for m in enum]
    if value not in allowed:
        raise _Bad(where, f"must be one of {allowed}, got {_describe(value)}")


def _list(where: str, value, each) -> None:
    if not isinstance(value, list):
        raise _Bad(where, f"must be a list, got {_describe(value)}")
    for i, item in enumerate(value):
        each(f"{where}[{i}]", item)


def _object(where: str, value, fields: dict, required: tuple[str, ...]) -> None:
    """``value`` must be a JSON object with only ``fields`` (name -> checker) and every ``required`` one."""
    if not isinstance(value, dict):
        raise _Bad(where, f"must be a JSON object, got {_describe(value)}")
    unknown = [k for k in value if k not in fields]
    if unknown:
        raise _Bad(f"{where}.{unknown[0]}", f"is not a field here (fields: {', '.join(fields)})")
    missing = [k for k in required if k not in value]
    if missing:
        raise _Bad(f"{where}.{missing[0]}", "is missing")
    for key, item in value.items():
        fields[key](f"{where}.{key}", item)


def _size(where: str, value) -> None:
    try:
        parse_size(value)
    except ShapeSyntaxError as e:
        raise _Bad(where, f"is not a size ({e}); a size holds whole numbers, symbols such as B and T, "
                          "+ - * / // ** and parentheses, as autotp writes them") from e


def _dim(where: str, value) -> None:
    if value is not None:
        _int(where, value)


_PLACEMENT = {"kind": lambda w, v: _choice(w, v, PlacementKind), "dim": _dim,
              "segments": lambda w, v: _list(w, v, lambda w2, s: _int(w2, s, 1)),
              "replicas": lambda w, v: _int(w, v, 1)}
_COLLECTIVE = {"op": lambda w, v: _choice(w, v, CollectiveOp), "direction": lambda w, v: _choice(w, v, Direction),
               "operator": lambda w, v: _choice(w, v, Operator), "module": _str,
               "shape": lambda w, v: _list(w, v, _size), "itemsize": lambda w, v: _int(w, v, 1),
               "in_step": _bool}
_NAMES = lambda w, v: _list(w, v, _str)  # noqa: E731
_REGION = {"kind": lambda w, v: _choice(w, v, RegionKind), "columns": _NAMES, "rows": _NAMES, "replicated": _NAMES}
_STAGE = {"index": _int, "modules": _NAMES, "flops": _number, "param_count": _int, "activation_bytes": _number,
          "boundary_bytes": _number}


_LAYOUT = {"tp": lambda w, v: _int(w, v, 1), "pp": lambda w, v: _int(w, v, 1), "dp": lambda w, v: _int(w, v, 1),
           "dp_mode": lambda w, v: _choice(w, v, DataParallelMode), "schedule": lambda w, v: _choice(w, v, Schedule),
           "microbatches": lambda w, v: _int(w, v, 1), "virtual_stages": lambda w, v: _int(w, v, 1),
           "sequence_parallel": _bool, "recompute": lambda w, v: _choice(w, v, Recompute), "step_time": _number, "compute": _number, "tp_comm": _number,
           "bubble": _number, "p2p": _number, "dp_comm": _number, "memory": _int, "fits": _bool, "vocab_split": _bool,
           "cp": lambda w, v: _int(w, v, 1), "cp_comm": _number, "ep": lambda w, v: _int(w, v, 1), "ep_comm": _number}
"""A ranked layout (``layout_cost.Prediction.to_dict``): every field required but ``recompute``, ``cp``,
``cp_comm``, ``ep`` and ``ep_comm`` (plans written before the search tried them: none)."""
_LAYOUT_REQUIRED = tuple(k for k in _LAYOUT if k not in ("recompute", "cp", "cp_comm", "ep", "ep_comm"))


def _options(where: str, value) -> None:
    if value is None:
        return
    try:
        Options.from_dict(value)
    except InputError as e:
        raise _Bad(where, str(e)) from None


def _placements(where: str, value) -> None:
    if not isinstance(value, dict):
        raise _Bad(where, f"must be a JSON object of parameter name -> placement, got {_describe(value)}")
    for name, placement in value.items():
        _object(f"{where}[{name!r}]", placement, _PLACEMENT, ("kind",))
        split, dim = placement["kind"] != PlacementKind.REPLICATED.value, placement.get("dim")
        if split == (dim is None):
            raise _Bad(f"{where}[{name!r}].dim", f"must be {'a whole number' if split else 'null'} for a "
                                                  f"{placement['kind']} placement, got {_describe(dim)}")


_PLAN = {"schema_version": lambda w, v: None, "model": _str, "tp": lambda w, v: _int(w, v, 1),
         "placements": _placements,
         "collectives": lambda w, v: _list(w, v, lambda w2, c: _object(w2, c, _COLLECTIVE,
                                                                        ("op", "direction", "operator", "module",
                                                                         "shape"))),
         "regions": lambda w, v: _list(w, v, lambda w2, r: _object(w2, r, _REGION, ("kind", "columns", "rows"))),
         "notes": _NAMES, "pp": lambda w, v: _int(w, v, 1), "balance": lambda w, v: _choice(w, v, Balance),
         "batch": _int, "seq": _int,
         "stages": lambda w, v: _list(w, v, lambda w2, s: _object(w2, s, _STAGE, ("index", "modules", "flops",
                                                                                   "param_count",
                                                                                   "activation_bytes"))),
         "by_choice": _NAMES, "sequence_parallel": _bool, "options": _options,
         "layouts": lambda w, v: _list(w, v, lambda w2, p: _object(w2, p, _LAYOUT, _LAYOUT_REQUIRED))}


def check_plan_data(data: dict) -> None:
    """Refuse, with an ``InputError`` naming the field, a plan dict (``Plan.to_dict``'s shape, as read from a
    file) with a field of the wrong type or range, an unknown or missing field, or a size outside the size
    language."""
    try:
        _object("plan", data, _PLAN, ("tp", "placements"))
    except _Bad as e:
        raise InputError(f"not a valid autotp plan: field {e.where} {e.what}; fix it in the plan file or "
                         "re-plan with autotp.plan") from None
