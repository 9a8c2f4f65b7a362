"""Sharding rules of ops over channels (``N, C, *spatial``, split along ``C``): grouped convolutions, batch and
group norms, pooling. Each keeps the channel split where every channel (or every group of channels) is computed
on its own; a dense convolution is a projection (``projections``), split column- or row-wise like a linear."""

from __future__ import annotations

import torch
from autotp.passes.graph import meta_val, rank, sizes
from autotp.passes.placement import Shard
from autotp.passes.projections import CONVOLUTIONS, conv_groups
from autotp.passes.rule_kit import Context, Decision, Inputs, on_split_input, replicate_all, sharded_inputs, size_checks
from autotp.passes.steps import Operator
from torch import fx

aten = torch.ops.aten


def _channels(node: fx.Node, x: fx.Node, lay: Shard, spatial: int) -> bool:
    """Whether ``x`` (read by ``node``) is batched channels-first data split along its channels: dim 1 of ``N, C``
    followed by ``spatial`` dims."""
    return lay.dim == 1 and rank(x) == spatial + 2


def _like_input(ins: Inputs, params: tuple, segments: tuple[int, ...]) -> Decision | None:
    """The wants of per-channel parameters (weight, bias, at ``params``) meeting channels split in ``segments``:
    sliced along their one dim, or None when one arrives split otherwise."""
    wants = {}
    for p in params:
        if p not in ins:
            continue
        lay = ins[p][1]
        if isinstance(lay, Shard) and lay != Shard(0, segments):
            return None
        if lay is None:
            wants[p] = Shard(0, segments)
    return Decision(Shard(1, segments), wants=wants)


def grouped_conv(node: fx.Node, ins: Inputs, ctx: Context) -> Decision:
    """A grouped convolution (depthwise: one group per channel, as in MobileNet's blocks and Mamba's mixers) with
    its channels split so that each rank holds whole groups: each rank convolves its own groups with its rows of
    the weight, ``groups`` becoming local. Its input arrives split so, or whole with the weight split by its
    output channels (a split that opens here, ``openings``): each rank then reads only its own channels of the
    whole input, a slice that costs nothing going forward. A dense one (one group) reaching here is kept whole:
    it is split as a projection when it is."""
    x, lay = ins[(0,)]
    weight, weight_lay = ins[(1,)]
    groups = conv_groups(node)
    spatial = rank(weight) - 2
    transposed = node.target is aten.convolution.default and node.args[6]
    if groups == 1 or transposed:
        return replicate_all(node, ins, ctx)
    per_group_in, per_group_out = sizes(x)[1] // groups, sizes(weight)[0] // groups
    if lay is None and isinstance(weight_lay, Shard) and weight_lay.dim == 0 and rank(x) == spatial + 2:
        if any(s % per_group_out for s in weight_lay.segments):
            return replicate_all(node, ins, ctx)  # a part would cut a group
        lay = Shard(1, tuple(s // per_group_out * per_group_in for s in weight_lay.segments))
        decision = _grouped(node, ins, ctx, lay, groups, per_group_in, per_group_out)
        if decision is not None:
            decision.wants[(0,)] = lay  # this rank's channels of the whole input
        return decision or replicate_all(node, ins, ctx)
    if not isinstance(lay, Shard) or not _channels(node, x, lay, spatial):
        return replicate_all(node, ins, ctx)
    return _grouped(node, ins, ctx, lay, groups, per_group_in, per_group_out) or replicate_all(node, ins, ctx)


def _grouped(node: fx.Node, ins: Inputs, ctx: Context, lay: Shard, groups: int, per_group_in: int,
             per_group_out: int) -> Decision | None:
    """A grouped convolution's decision for its input channels split as ``lay``, or None when a part would cut a
    group or a parameter arrives split otherwise."""
    if any(s % per_group_in for s in lay.segments):
        return None  # a part would cut a group
    out_segments = tuple(s // per_group_in * per_group_out for s in lay.segments)
    decision = _like_input(ins, tuple(p for p in ins if p != (0,)), out_segments)
    if decision is None:
        return None
    decision.out = Shard(1, out_segments)
    decision.fixes = {(CONVOLUTIONS[node.target],): groups // ctx.tp}
    decision.checks = [(s // per_group_in, "groups of the convolution") for s in lay.segments]
    return decision


@on_split_input
def batch_norm(node: fx.Node, ins: Inputs, ctx: Context, x: fx.Node, lay: Shard) -> Decision:
    """``aten.batch_norm`` of channels split: every channel's statistics are its own (over the batch and the
    positions, in training; the running ones in evaluation), so each rank normalises its channels with its slice
    of the weight and bias. The running statistics stay whole buffers on every rank: the rewrite reads this rank's
    part, and in training, which updates them, all-gathers the parts it updated (``RUNNING_STATS``)."""
    if lay.dim != 1 or rank(x) < 2:
        return replicate_all(node, ins, ctx)
    if any(isinstance(ins[p][1], Shard) for p in ((3,), (4,)) if p in ins):
        return replicate_all(node, ins, ctx)
    decision = _like_input(ins, ((1,), (2,)), lay.segments)
    if decision is None:
        return replicate_all(node, ins, ctx)
    if (3,) in ins and node.args[5]:  # training updates the running statistics: the rewrite shares each rank's
        decision.reduce = Operator.RUNNING_STATS
    elif (3,) in ins:  # evaluation only reads them: this rank's slice
        decision.wants |= {p: Shard(0, lay.segments) for p in ((3,), (4,)) if p in ins}
    return decision


@on_split_input
def group_norm(node: fx.Node, ins: Inputs, ctx: Context, x: fx.Node, lay: Shard) -> Decision:
    """``aten.group_norm`` of channels split so that each rank holds whole groups: each group's statistics are
    its own, so each rank normalises its groups (``num_groups`` becoming local); a split that cuts a group sees
    the input whole."""
    groups = node.args[1]
    if lay.dim != 1 or rank(x) < 2 or len(lay.segments) != 1 or groups % ctx.tp:
        return replicate_all(node, ins, ctx)
    decision = _like_input(ins, ((2,), (3,)), lay.segments)
    if decision is None:
        return replicate_all(node, ins, ctx)
    decision.fixes = {(1,): groups // ctx.tp}
    decision.checks = size_checks(lay, "channels of the group norm")
    return decision


_POOLS = {aten.avg_pool1d.default: 1, aten.avg_pool2d.default: 2, aten.avg_pool3d.default: 3,
          aten.max_pool1d.default: 1, aten.max_pool2d.default: 2, aten.max_pool3d.default: 3,
          aten.max_pool2d_with_indices.default: 2, aten.max_pool3d_with_indices.default: 3,
          aten.adaptive_avg_pool1d.default: 1, aten.adaptive_avg_pool2d.default: 2,
          aten.adaptive_avg_pool3d.default: 3, aten.adaptive_max_pool1d.default: 1,
          aten.adaptive_max_pool2d.default: 2, aten.adaptive_max_pool3d.default: 3,
          aten.upsample_nearest1d.vec: 1, aten.upsample_nearest2d.vec: 2, aten.upsample_nearest3d.vec: 3,
          aten.upsample_linear1d.vec: 1, aten.upsample_bilinear2d.vec: 2, aten.upsample_bicubic2d.vec: 2,
          aten.upsample_trilinear3d.vec: 3, aten.reflection_pad1d.default: 1, aten.reflection_pad2d.default: 2,
          aten.replication_pad1d.default: 1, aten.replication_pad2d.default: 2}
"""Ops over each channel's positions alone, by how many trailing spatial dims they work over."""


def spatial_dims(node: fx.Node) -> int:
    """How many trailing spatial dims a ``spatial_op`` works over (a dim before them can stay split)."""
    return _POOLS[node.target]


def spatial_op(node: fx.Node, ins: Inputs, ctx: Context) -> Decision:
    """Pooling, resizing and padding over the trailing spatial dims: each channel on its own, so a split of any
    dim before them stays (every output, indices included, split alike)."""
    sharded = sharded_inputs(ins)
    if not sharded:
        return Decision(None)
    path, x, lay = sharded[0]
    if len(sharded) != 1 or path != (0,) or lay.dim >= rank(x) - spatial_dims(node):
        return replicate_all(node, ins, ctx)
    outputs = meta_val(node)
    return Decision(tuple(lay for _ in outputs) if isinstance(outputs, (tuple, list)) else lay)


CHANNEL_RULES = {**{op: grouped_conv for op in CONVOLUTIONS}, aten.batch_norm.default: batch_norm,
                 aten.group_norm.default: group_norm, **{op: spatial_op for op in _POOLS}}
"""The rules of this module, by op."""
