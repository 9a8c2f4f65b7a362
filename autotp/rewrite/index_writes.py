"""Writes at indices along a split dim: each rank writes only the indices within its chunk.

``logits[:, :, image_tokens] = finfo.min`` (Chameleon suppresses its image tokens) on logits split by vocabulary:
the rank holding vocabulary rows ``[start, start + length)`` writes the indices that fall there, shifted to its
own positions; the others are another rank's (``passes.rules_shape.index_put``).
"""

from __future__ import annotations

import torch
from torch import fx

from autotp.passes.graph import WritesWithin, arg_or_default
from autotp.passes.placement import chunk_span

aten = torch.ops.aten


def index_put_within(x: torch.Tensor, indices: list, value: torch.Tensor, accumulate: bool, in_place: bool,
                     dim: int, start: int, length: int, size: int) -> torch.Tensor:
    """``x.index_put(indices, value, accumulate)`` (in place or not) where ``x`` holds positions
    ``[start, start + length)`` of a dim of ``size`` along ``dim``, indexed by ``indices[dim]``: the indices in
    that range, shifted to ``x``'s positions (negative ones counted from the end, as torch does)."""
    index = indices[dim]
    index = torch.where(index < 0, index + size, index)
    local = index[(index >= start) & (index < start + length)] - start
    indices = [local if d == dim else idx for d, idx in enumerate(indices)]
    op = aten.index_put_.default if in_place else aten.index_put.default
    return op(x, indices, value, accumulate)


def write_within(node: fx.Node, fix: WritesWithin, rank: int, tp: int) -> None:
    """Make ``node`` (an ``index_put``) this rank's writes within its chunk along ``fix.dim``."""
    start, length = chunk_span(fix.size, fix.chunks, rank // (tp // fix.chunks))
    accumulate = arg_or_default(node, 3, "accumulate", False)
    in_place = node.target is aten.index_put_.default
    node.target = index_put_within
    node.args = (node.args[0], node.args[1], node.args[2], accumulate, in_place, fix.dim, start, length, fix.size)
    node.kwargs = {}
