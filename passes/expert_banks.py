"""One expert's matrix read out of a parameter that holds every expert's, as loops over experts read them.

A bank ``W[experts, in, out]`` indexed per expert (``W[e]``: JetMoE's ``F.linear(x_e, self.weight[e])``, the
privacy filter's ``x_e.float() @ self.gate_up_proj[e].float()``) is split along one expert's matrix dims, the
same for every expert. A 2-D parameter holding the experts' rows one after another, viewed as
``(experts, rows, ...)`` and indexed (DBRX's ``w1.view(-1, ffn, hidden)[e]``), is split alike in every expert's
block of rows: its segments are one expert's, once per expert (``per_expert``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import fx

from autotp.passes.graph import CASTS, meta_val, param_attr

if TYPE_CHECKING:
    from autotp.passes.projections import Projection

aten = torch.ops.aten

_VIEWS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default}


def _expert_pick(node) -> fx.Node | None:
    """The value ``node`` takes one expert's matrix of (``select`` along the first dim), looking through a cast of
    the pick (an expert computed in float32)."""
    if isinstance(node, fx.Node) and node.op == "call_function" and node.target in CASTS:
        node = node.args[0]
    if not isinstance(node, fx.Node) or node.target is not aten.select.int or node.args[1] != 0:
        return None
    return node.args[0]


def expert_attr(node) -> str | None:
    """The ``get_attr`` target if ``node`` is one expert's matrix of a parameter bank, ``W[e]``, or a cast of it."""
    bank = _expert_pick(node)
    return param_attr(bank) if bank is not None else None


def folded_expert(node) -> tuple[str, int] | None:
    """(``get_attr`` target, experts) if ``node`` is one expert's matrix of a parameter whose first dim holds the
    experts' rows one after another: ``W.view(experts, rows, ...)[e]``, or a cast of it."""
    view = _expert_pick(node)
    if not isinstance(view, fx.Node) or view.target not in _VIEWS or param_attr(view.args[0]) is None:
        return None
    whole, banked = tuple(meta_val(view.args[0]).shape), tuple(meta_val(view).shape)
    if len(banked) != len(whole) + 1 or banked[2:] != whole[1:] or banked[0] * banked[1] != whole[0]:
        return None
    return param_attr(view.args[0]), int(banked[0])


def per_expert(proj: Projection, segments: tuple[int, ...]) -> tuple[int, ...]:
    """The parameter's segments along a storage dim its experts lie along (``Projection.experts``), for one
    expert's ``segments``: the same split in every expert's block."""
    return tuple(segments) * proj.experts


def one_expert(proj: Projection, segments: tuple[int, ...]) -> tuple[int, ...] | None:
    """One expert's segments of a parameter's split along the dim its experts lie along (the inverse of
    ``per_expert``), or None when the experts are not split alike."""
    count, rest = divmod(len(segments), proj.experts)
    first = tuple(segments[:count])
    return first if not rest and first and first * proj.experts == tuple(segments) else None
