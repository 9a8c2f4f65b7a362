"""Sharding rules of ops that compute along dims: reductions (an all-reduce when over the split dim), matmuls,
attention, norms (convolutions and other ops over channels: ``rules_channels``). Each keeps a split where the computation is per slice, or sees its input whole."""

from __future__ import annotations

import torch
from autotp.passes.graph import arg_or_default, named_arg, rank, sizes
from autotp.passes.placement import Shard, same_split
from autotp.passes.reshapes import static
from autotp.passes.rule_kit import (
    Context,
    Decision,
    Inputs,
    aligned,
    join,
    multi_output,
    norm_dim,
    on_split_input,
    pointwise,
    replicate_all,
    sharded_inputs,
    size_checks,
)
from autotp.passes.steps import COPY, Operator
from torch import fx

aten = torch.ops.aten


_ACROSS_SHARDS = {aten.sum.dim_IntList: Operator.G, aten.mean.dim: Operator.MEAN}
"""Reductions over the split dim that an all-reduce of the per-rank results completes (a norm's statistic:
RMSNorm's mean of squares over all heads is the average of the ranks' means, every shard being equal)."""


@on_split_input
def along_dim(node: fx.Node, ins: Inputs, ctx: Context, x: fx.Node, lay: Shard) -> Decision:
    """Ops that work along one dim and keep the shape (softmax, cumsum): fine unless it is the shard dim."""
    if norm_dim(arg_or_default(node, 1, "dim", 0), rank(x)) == lay.dim:
        return replicate_all(node, ins, ctx)
    return Decision(lay)


@on_split_input
def reduction(node: fx.Node, ins: Inputs, ctx: Context, x: fx.Node, lay: Shard) -> Decision:
    """sum/mean/amax/var/max over dims other than the shard dim; a sum or mean over it is all-reduced."""
    dims = named_arg(node, "dim", None)  # by name: a vector norm's dims come after its order
    if dims is None or dims == []:
        return replicate_all(node, ins, ctx)
    dims = [norm_dim(d, rank(x)) for d in ([dims] if isinstance(dims, int) else dims)]
    if lay.dim in dims:
        if node.target in _ACROSS_SHARDS and ctx.tp > 1 and lay.blocks == 1 and lay.replicas == 1:
            return Decision(None, reduce=_ACROSS_SHARDS[node.target])
        return replicate_all(node, ins, ctx)
    keepdim = named_arg(node, "keepdim", False)
    out = lay if keepdim else lay.moved(lay.dim - sum(d < lay.dim for d in dims))
    return Decision((out, out) if multi_output(node) else out)


@on_split_input
def cross_entropy(node: fx.Node, ins: Inputs, ctx: Context, x: fx.Node, lay: Shard) -> Decision:
    """``cross_entropy_loss`` of logits split along the classes (a vocabulary-split head's): Megatron's
    vocab-parallel cross-entropy, which reduces each token's statistics instead of gathering the logits (label
    smoothing adds each rank's sum of logits to them). Class weights and uneven or blocked splits take the
    logits whole."""
    classes = 1 if rank(x) >= 2 else 0
    plain = named_arg(node, "weight", None) is None
    if lay.dim != classes or lay.blocks != 1 or len(lay.segments) != 1 or not plain or ctx.tp == 1:
        return replicate_all(node, ins, ctx)
    return Decision(None, wants={(1,): None}, reduce=Operator.CROSS_ENTROPY,
                    checks=size_checks(lay, "classes of the cross-entropy"))


def batched_matmul(node: fx.Node, ins: Inputs, ctx: Context) -> Decision:
    """matmul/bmm of activations (QKᵀ, attention·V): sharded along a batch dim (the heads)."""
    sharded = sharded_inputs(ins)
    if not sharded:
        return Decision(None)
    if all(lay.dim < rank(n) - 2 for _, n, lay in sharded):
        return aligned(node, ins, ctx, sharded)  # a batch dim (the heads)
    return _matrix_split(node, ins, ctx)


def baddbmm(node: fx.Node, ins: Inputs, ctx: Context) -> Decision:
    """``beta * input + alpha * (b1 @ b2)`` (scores plus an ALiBi bias, heads folded into the batch): split
    along the batch of the product, the added input joined to it."""
    sharded = sharded_inputs(ins)
    if not sharded:
        return Decision(None)
    if any(p != (0,) and lay.dim != 0 for p, _, lay in sharded):
        return replicate_all(node, ins, ctx)
    return aligned(node, ins, ctx, sharded)


@on_split_input
def layer_norm(node: fx.Node, ins: Inputs, ctx: Context, x: fx.Node, lay: Shard) -> Decision:
    """layer_norm (and rms_norm, whose arguments come in the same places) over trailing dims other than the split
    one (a per-head QK norm): each rank normalises its own heads with the whole weight, whose gradient is then this rank's share (through ``f``)."""
    if lay.dim >= rank(x) - len(node.args[1]):
        return replicate_all(node, ins, ctx)
    return Decision(lay, wants={p: COPY if n.name in ctx.grad else None for p, (n, _) in ins.items() if p != (0,)})


@on_split_input
def last_two_dims(node: fx.Node, ins: Inputs, ctx: Context, x: fx.Node, lay: Shard) -> Decision:
    """Ops on each matrix of a batch (tril, triu): fine when the split is a batch dim (the heads)."""
    return Decision(lay) if lay.dim < rank(x) - 2 else replicate_all(node, ins, ctx)


@on_split_input
def copy_into(node: fx.Node, ins: Inputs, ctx: Context, x: fx.Node, lay: Shard) -> Decision:
    """``dst.copy_(src)`` into a split ``dst``: each rank writes its own part, ``src`` split alike (or sliced,
    or broadcast). A whole ``dst`` takes a whole ``src`` (the decorator's rule)."""
    decision = pointwise(node, ins, ctx)
    return decision if decision.out == lay else replicate_all(node, ins, ctx)


def _matrix_split(node: fx.Node, ins: Inputs, ctx: Context) -> Decision:
    """``a @ b`` split along a matrix dim: rows of ``a`` or columns of ``b`` give rows or columns of the
    product (the other operand whole); the contracted dim split on both gives partial sums, all-reduced."""
    (a, la), (b, lb) = ins[(0,)], ins[(1,)]
    ra, rb = rank(a), rank(b)
    if any(isinstance(lay, Shard) and lay.blocks != 1 for lay in (la, lb)):
        return replicate_all(node, ins, ctx)
    if ra < 2 or rb < 2 or any(isinstance(lay, Shard) and lay.dim < r - 2 for lay, r in ((la, ra), (lb, rb))):
        return replicate_all(node, ins, ctx)
    whole = {p: (COPY if n.name in ctx.grad else None) for p, (n, lay) in ins.items() if lay is None}
    contracted_a = isinstance(la, Shard) and la.dim == ra - 1
    contracted_b = isinstance(lb, Shard) and lb.dim == rb - 2
    if contracted_a or contracted_b:
        segments = (la if contracted_a else lb).segments
        want_a, want_b = Shard(ra - 1, segments), Shard(rb - 2, segments)
        if la not in (None, want_a) or lb not in (None, want_b):
            return replicate_all(node, ins, ctx)
        wants = {p: want for p, want, lay in (((0,), want_a, la), ((1,), want_b, lb)) if lay is None}
        return Decision(None, wants=wants, reduce=Operator.G)
    if isinstance(la, Shard) and lb is None:  # rows of a
        return Decision(Shard(rank(node) - 2, la.segments), wants=whole)
    if isinstance(lb, Shard) and la is None:  # columns of b
        return Decision(Shard(rank(node) - 1, lb.segments), wants=whole)
    return replicate_all(node, ins, ctx)


def attention(node: fx.Node, ins: Inputs, ctx: Context) -> Decision:
    """scaled_dot_product_attention split by heads: the first of Q, K, V and the mask split by heads leads,
    the others follow it (sliced when whole; split any other way, inside a head, made so)."""
    q, _ = ins[(0,)]
    heads = rank(q) - 3
    leading = [ins[p][1] for p in ((0,), (1,), (2,), (3,)) if p in ins and isinstance(ins[p][1], Shard)
               and ins[p][1].dim == heads and rank(ins[p][0]) == rank(q)]  # a per-head bias shared by later layers may lead too
    if not leading:
        return replicate_all(node, ins, ctx) if sharded_inputs(ins) else Decision(None)
    lay = leading[0]
    gqa = arg_or_default(node, 7, "enable_gqa", False)
    if gqa and lay.blocks != 1:
        return replicate_all(node, ins, ctx)
    if gqa:
        # Each query head reads KV head h // (H / KV): contiguous chunks of both keep that on every rank.
        counts = [static(sizes(ins[p][0])[heads]) for p in ((0,), (1,), (2,))]
        if any(len(v[1].segments) != 1 for v in ins.values() if isinstance(v[1], Shard)) or \
                any(c is None or c % ctx.tp for c in counts):
            return replicate_all(node, ins, ctx)  # fewer KV heads than ranks: kept whole
        own = {p: Shard(heads, (c,)) for p, c in zip(((0,), (1,), (2,)), counts)}
        wants = {p: w for p, w in own.items() if ins[p][1] != w}
        lay = own[(0,)]
        checks = [(c, "attention heads") for c in counts]
    else:
        # heads split within blocks (JetMoE's query heads, [experts chosen, heads], beside K/V repeated per
        # expert chosen): each rank's heads of every block, on Q, K and V alike
        wants = {p: Shard(heads, lay.segments, lay.blocks) for p in ((0,), (1,), (2,))
                 if not same_split(ins[p][1], lay)}
        checks = []
    mask = {p: v for p, v in ins.items() if p not in ((0,), (1,), (2,))}
    if any(isinstance(v[1], Shard) and v[1] != lay for v in mask.values()):
        return replicate_all(node, ins, ctx)
    wants |= join(node, mask, ctx, heads, lay.segments, blocks=lay.blocks)
    return Decision(lay, wants=wants, checks=checks)


def _einsum_specs(equation: str, ranks: list[int]) -> tuple[list[str], str] | None:
    """The operands' and the output's index letters of an einsum ``equation`` (None with an ellipsis, or a
    letter repeated within one operand: a diagonal, which no split keeps per slice)."""
    if "..." in equation or "->" not in equation:
        return None
    inputs, out = equation.replace(" ", "").split("->")
    specs = inputs.split(",")
    if len(specs) != len(ranks) or any(len(s) != r or len(set(s)) != r for s, r in zip(specs, ranks)):
        return None
    return specs, out


def einsum(node: fx.Node, ins: Inputs, ctx: Context) -> Decision:
    """``einsum`` with operands split along one index letter: kept in the output (a batch or free index),
    the output is split there; summed over (contracted), each rank's partial sum is all-reduced. Whole
    operands that carry the letter are sliced; the others stay whole (through ``f`` when gradients flow)."""
    sharded = sharded_inputs(ins)
    if not sharded:
        return Decision(None)
    operands = node.args[1]
    parsed = _einsum_specs(node.args[0], [rank(t) for t in operands])
    if parsed is None or any(lay.blocks != 1 for _, _, lay in sharded):
        return replicate_all(node, ins, ctx)
    specs, out = parsed
    letters = {(specs[p[1]][lay.dim], lay.segments) for p, _, lay in sharded}
    if len(letters) != 1:
        return replicate_all(node, ins, ctx)
    (letter, segments), = letters
    wants = {}
    for p, (n, lay) in ins.items():
        if isinstance(lay, Shard):
            continue
        spec = specs[p[1]]
        if letter in spec and sizes(n)[spec.index(letter)] != 1:
            wants[p] = Shard(spec.index(letter), segments)
        else:
            wants[p] = COPY if n.name in ctx.grad else None
    if letter in out:
        return Decision(Shard(out.index(letter), segments), wants=wants, checks=size_checks(Shard(0, segments), "einsum"))
    if any(letter in specs[p[1]] and sizes(n)[specs[p[1]].index(letter)] == 1 for p, (n, _) in ins.items()):
        return replicate_all(node, ins, ctx)  # a broadcast operand would be summed tp times
    return Decision(None, wants=wants, reduce=Operator.G, checks=size_checks(Shard(0, segments), "einsum"))
