"""Sharding rules of ops that write into a tensor at positions: ``index_put`` (at indices, in place or not),
``index_copy`` and ``index_add`` (along a dim at an index). Each rank writes its part of the tensor, or the
positions within its chunk; the positions themselves stay whole."""

from __future__ import annotations

import torch
from autotp.passes.graph import WritesWithin, meta_val, rank, sizes
from autotp.passes.placement import Shard
from autotp.passes.rule_kit import Context, Decision, Inputs, norm_dim, replicate_all, sharded_inputs, size_checks
from torch import fx


def index_put(node: fx.Node, ins: Inputs, ctx: Context) -> Decision:
    """``x[..., idx, ...] = value`` (``index_put``, in place or not) with ``x`` split and ``value`` one number:
    along a dim no index indexes, each rank writes its slice; along the one dim a 1-D index indexes (token ids
    of a vocabulary-split logits, suppressed: Chameleon's image tokens), each rank writes the indices within its
    chunk, shifted to its positions (``WritesWithin``). The indices are whole."""
    x, lay = ins[(0,)]
    indices, value = node.args[1], node.args[2]
    if not isinstance(lay, Shard) or lay.blocks != 1 or lay.replicas != 1 or lay.spread \
            or any(isinstance(have, Shard) for p, (_, have) in ins.items() if p != (0,)) \
            or not isinstance(value, fx.Node) or any(size != 1 for size in sizes(value)):
        return replicate_all(node, ins, ctx) if sharded_inputs(ins) else Decision(None)
    if any(idx is not None and meta_val(idx).dtype in (torch.bool, torch.uint8) for idx in indices):
        return replicate_all(node, ins, ctx)  # a mask indexes as many dims as it has
    wants = {p: None for p in ins if p != (0,)}
    indexed = [d for d, idx in enumerate(indices) if idx is not None]
    if lay.dim not in indexed:
        return Decision(lay, wants=wants)  # every rank writes its slice of the positions
    if indexed == [lay.dim] and rank(indices[lay.dim]) == 1 and len(lay.segments) == 1:
        size = lay.segments[0]
        return Decision(lay, wants=wants, fixes={(1,): WritesWithin(lay.dim, size, ctx.tp)},
                        checks=size_checks(lay, "a dim written at indices"))
    return replicate_all(node, ins, ctx)


def index_copy(node: fx.Node, ins: Inputs, ctx: Context) -> Decision:
    """``x.index_copy(dim, index, src)`` (a static KV cache written at the new tokens' positions) and
    ``x.index_add(dim, index, src)`` (mixture-of-experts outputs put back in token order) split along any dim but
    ``dim``: each rank writes or adds its part of ``src`` into its part of ``x`` (a cache placed like the K/V heads
    written into it); the positions are whole."""
    if (2,) in ins and isinstance(ins[(2,)][1], Shard):
        return replicate_all(node, ins, ctx)
    dim = norm_dim(node.args[1], rank(node))
    lays = {lay for p, _, lay in sharded_inputs(ins) if p in ((0,), (3,))}
    if not lays:
        return Decision(None)
    lay = lays.pop()
    if lays or lay.dim == dim or lay.spread or rank(ins[(0,)][0]) != rank(ins[(3,)][0]):
        return replicate_all(node, ins, ctx)
    return Decision(lay, wants={p: lay for p in ((0,), (3,)) if ins[p][1] != lay})
