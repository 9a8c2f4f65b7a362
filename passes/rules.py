"""Per-op sharding rules: which rule each op has (``rule_for``).

Rules live by kind in ``rules_shape`` (ops that move data) and ``rules_compute`` (ops that compute along
dims), built from ``rule_kit``. Unknown ops get the safe rule: every input replicated. Nothing here looks at
module or parameter names.
"""

from __future__ import annotations

import operator

import torch

from autotp.torch_private import is_op_overload, overload_packet
from autotp.passes.rule_kit import Context, Decision, like_first, no_output, pointwise, replicate_all
from autotp.passes.rules_compute import (
    along_dim,
    attention,
    baddbmm,
    batched_matmul,
    copy_into,
    cross_entropy,
    einsum,
    last_two_dims,
    layer_norm,
    reduction,
    shared_linear,
)
from autotp.passes.random_ops import SIZE_ONLY_OPS, RandomKind, random_kind
from autotp.passes.rules_channels import CHANNEL_RULES
from autotp.passes.rules_shape import (
    cat,
    expand,
    gather,
    getitem,
    new_filled,
    index,
    index_select,
    pad,
    permute,
    repeat,
    repeat_interleave,
    reshape,
    select,
    slice_,
    split,
    stack,
    sym_size,
    view_as,
    view_as_complex,
)
from autotp.passes.rules_writes import index_copy, index_put

__all__ = ["BLOCK_AWARE", "REPLICA_AWARE", "RULES", "SPREAD_AWARE", "Context", "Decision", "replicate_all", "rule_for"]

aten = torch.ops.aten

RULES = {
    aten.view.default: reshape, aten.reshape.default: reshape, aten._unsafe_view.default: reshape,
    aten.unsqueeze.default: reshape, aten.squeeze.dim: reshape, aten.squeeze.dims: reshape,
    aten.squeeze.default: reshape, aten.flatten.using_ints: reshape, aten.unflatten.int: reshape,
    aten.expand.default: expand,
    aten.permute.default: permute, aten.transpose.int: permute, aten.t.default: permute,
    aten.numpy_T.default: permute,
    aten.split.Tensor: split, aten.split_with_sizes.default: split, aten.chunk.default: split,
    aten.unbind.int: split,
    operator.getitem: getitem,
    aten.slice.Tensor: slice_, aten.select.int: select, aten.cat.default: cat, aten.concatenate.default: cat, aten.gather.default: gather, aten.stack.default: stack,
    aten.softmax.int: along_dim, aten._softmax.default: along_dim, aten.log_softmax.int: along_dim,
    aten._log_softmax.default: along_dim, aten.cumsum.default: along_dim,
    aten.cross_entropy_loss.default: cross_entropy,
    aten.sum.dim_IntList: reduction, aten.mean.dim: reduction, aten.amax.default: reduction,
    aten.amin.default: reduction, aten.var.correction: reduction, aten.std.correction: reduction,
    aten.var.dim: reduction, aten.std.dim: reduction, aten.var_mean.correction: reduction,
    aten.max.dim: reduction, aten.min.dim: reduction, aten.linalg_vector_norm.default: reduction,
    # ``x.expand_as(y)`` broadcasts like ``x + y``, to y's (local) shape: F.normalize's norm to the heads it divides
    aten.expand_as.default: pointwise,
    aten.linear.default: shared_linear,
    aten.matmul.default: batched_matmul, aten.bmm.default: batched_matmul,
    aten.scaled_dot_product_attention.default: attention,
    aten.view_as.default: view_as, aten.reshape_as.default: view_as, aten.einsum.default: einsum,
    aten.log_sigmoid.default: pointwise, aten.sym_size.int: sym_size, aten.index.Tensor: index, aten.index_select.default: index_select, aten.repeat.default: repeat,
    aten.logsumexp.default: reduction, aten.copy_.default: copy_into, aten.tril.default: last_two_dims, aten.triu.default: last_two_dims, aten.pad.default: pad, aten.constant_pad_nd.default: pad, aten.repeat_interleave.self_int: repeat_interleave, aten.baddbmm.default: baddbmm, aten.layer_norm.default: layer_norm, aten.rms_norm.default: layer_norm, aten.view_as_complex.default: view_as_complex,
    aten.view_as_real.default: view_as_complex,
    # pointwise, though not tagged so: a scalar on one side, or a 0-d tensor fill value
    aten.where.ScalarOther: pointwise, aten.where.ScalarSelf: pointwise, aten.where.Scalar: pointwise,
    aten.masked_fill.Tensor: pointwise,
    aten.hardswish.default: pointwise,  # elementwise, not tagged so (MobileNet-v3's and PP-LCNet's activation)
    aten._assert_tensor_metadata.default: no_output,
    aten.new_empty.default: new_filled, aten.new_zeros.default: new_filled, aten.new_ones.default: new_filled,
    aten.new_full.default: new_filled,
    aten.index_copy.default: index_copy, aten.index_add.default: index_copy,
    aten.index_put.default: index_put, aten.index_put_.default: index_put,
    **CHANNEL_RULES,
}


for _op in (aten.to.dtype, aten.to.dtype_layout, aten.to.device, aten._to_copy.default, aten.contiguous.default,
            aten.detach.default, aten.alias.default, aten.dropout.default, aten.type_as.default,
            aten.lift_fresh_copy.default, aten.zeros_like.default, aten.ones_like.default, aten.empty_like.default,
            aten.full_like.default, aten.clone.default):
    RULES[_op] = like_first


def size_only_draw(node, ins, ctx: Context) -> Decision:
    """A draw the size of its first input that ignores its values (``rand_like``, ``bernoulli(x, p)``): laid out like
    that input, as the rewriter draws it full-size and keeps this rank's part (``rewrite.random_draws``); one that
    reads another tensor (``bernoulli(x, p)`` with ``p`` a tensor) takes every input whole."""
    if random_kind(node) is not RandomKind.SIZE_ONLY:
        return replicate_all(node, ins, ctx)
    return like_first(node, ins, ctx)


for _op in SIZE_ONLY_OPS:
    RULES[_op] = size_only_draw


BLOCK_AWARE = frozenset({reshape, permute, like_first, getitem, pointwise, batched_matmul, baddbmm, along_dim,
                         reduction, no_output, gather, attention, shared_linear})
"""The rules that keep a split repeated over blocks (``Shard.blocks``) meaningful; others see such inputs whole."""


REPLICA_AWARE = frozenset({reshape, permute, like_first, getitem, pointwise, slice_, cat, expand, sym_size, no_output,
                           reduction, along_dim, layer_norm, split, index_copy})
"""The rules that keep chunks several ranks hold (``Shard.replicas``) meaningful; others see such inputs whole.
Of them, only ``reshape`` merges a spread chunk (``Shard.spread``) and ``like_first`` passes it on."""

SPREAD_AWARE = frozenset({reshape, like_first, no_output})


def rule_for(target) -> callable:
    """The sharding rule of an op: its own, the pointwise rule for ops tagged pointwise, an in-place op its
    functional form's (``masked_fill_`` splits as ``masked_fill``: it writes each rank's slice in place),
    else replicate."""
    if target in RULES:
        return RULES[target]
    if is_op_overload(target) and torch.Tag.pointwise in target.tags:
        return pointwise
    functional = _functional(target)
    return rule_for(functional) if functional is not None else replicate_all


def _functional(target):
    """The out-of-place overload of an in-place ATen op (``masked_fill_.Scalar`` -> ``masked_fill.Scalar``)."""
    if not is_op_overload(target) or torch.Tag.inplace not in target.tags:
        return None
    packet = getattr(torch.ops.aten, overload_packet(target).__name__.rstrip("_"), None)
    return getattr(packet, target._overloadname, None) if packet is not None else None
