"""Per-op sharding rules: given the layouts of an op's inputs, the layout of its output.

A rule returns a ``Decision``: the output layout, the layout it needs each input in (the
propagation engine inserts the conversion when an input arrives otherwise), the shape constants
that must change on the shard, and the sizes that must divide by tp. Unknown ops get the safe rule:
every input replicated. Nothing here looks at module or parameter names.
"""

from __future__ import annotations

import functools
import operator
from dataclasses import dataclass, field

import torch
from torch import fx

from autotp.passes.graph import ArgPath, DividedBy, arg_or_default, is_tensor, meta_val, rank, sizes
from autotp.passes.layout import Layout, Shard, broadcast_dim, map_reshape, static
from autotp.passes.steps import COPY, Operator, Step

aten = torch.ops.aten


@dataclass
class Decision:
    """What one op does with sharded inputs."""

    out: Layout
    wants: dict[ArgPath, Layout | Step] = field(default_factory=dict)
    """The layout each input must arrive in; ``COPY``: whole, through Megatron's ``f`` (the consumer
    sees only this rank's share of the gradient)."""
    fixes: dict[ArgPath, object] = field(default_factory=dict)
    checks: list[tuple[int, str]] = field(default_factory=list)
    """(size, what it counts): sizes that must divide by tp."""
    hint: tuple[int, ...] | None = None
    """Segment sizes the input would need to be split like (a fused projection seen by a split)."""
    reduce: Operator | None = None
    """The collective that completes the op's per-rank result (a sum over the split dim: ``G``)."""


Inputs = dict  # ArgPath -> (input node, its layout)


@dataclass
class Context:
    """What rules may consult besides the op: tp and which values carry gradients."""

    tp: int
    grad: set[str]


def _norm(dim: int, ndim: int) -> int:
    return dim + ndim if dim < 0 else dim


def _sharded(ins: Inputs) -> list[tuple[ArgPath, fx.Node, Shard]]:
    return [(p, n, lay) for p, (n, lay) in ins.items() if isinstance(lay, Shard)]


def _multi(node: fx.Node) -> bool:
    return isinstance(meta_val(node), (tuple, list))


def on_split_input(rule):
    """For a rule about its first input split along one dim: a whole first input gives a whole output.

    The wrapped rule is called as ``rule(node, ins, ctx, x, layout)`` with the first input and its Shard.
    """
    @functools.wraps(rule)
    def checked(node: fx.Node, ins: Inputs, ctx: Context) -> Decision:
        x, lay = ins[(0,)]
        if not isinstance(lay, Shard):
            return Decision(None)
        return rule(node, ins, ctx, x, lay)
    return checked


def replicate_all(node: fx.Node, ins: Inputs, ctx: Context) -> Decision:
    """The safe rule: the op sees full tensors and produces full tensors."""
    out = tuple(None for _ in meta_val(node)) if _multi(node) else None
    return Decision(out, wants={p: None for p in ins})


def _join(node: fx.Node, ins: Inputs, ctx: Context, out_dim: int, segments: tuple[int, ...],
          skip: set = frozenset(), blocks: object = 1) -> dict:
    """Wanted layouts for replicated inputs meeting a value sharded at output dim ``out_dim``.

    A broadcast input (size 1 or absent there) stays whole, through ``f`` if gradients flow to it
    (each rank sees only its share of that gradient); a full-size one is sliced to this rank's part.
    """
    wants = {}
    out_rank = rank(node)
    for p, (n, lay) in ins.items():
        if p in skip or isinstance(lay, Shard) or not is_tensor(n):
            continue
        d = broadcast_dim(out_rank, rank(n), out_dim)
        if d < 0 or sizes(n)[d] == 1:
            wants[p] = COPY if n.name in ctx.grad else None
        else:
            wants[p] = Shard(d, segments, blocks)
    return wants


def pointwise(node: fx.Node, ins: Inputs, ctx: Context) -> Decision:
    """Elementwise ops with broadcasting: all sharded inputs must agree on the output dim."""
    sharded = _sharded(ins)
    if not sharded:
        return Decision(None)
    return _aligned(node, ins, ctx, sharded)


def _aligned(node: fx.Node, ins: Inputs, ctx: Context, sharded) -> Decision:
    """The output split where every sharded input's split lands (aligned from the right, as broadcasting
    aligns dims), the other inputs joined to it; replicated when the inputs disagree."""
    out_rank = rank(node)
    targets = {(lay.dim + out_rank - rank(n), lay.segments, lay.blocks) for _, n, lay in sharded}
    if len(targets) != 1:
        return replicate_all(node, ins, ctx)
    out_dim, segments, blocks = targets.pop()
    return Decision(Shard(out_dim, segments, blocks), wants=_join(node, ins, ctx, out_dim, segments, blocks=blocks))


def like_first(node: fx.Node, ins: Inputs, ctx: Context) -> Decision:
    """Ops whose output is laid out like their first input (casts, copies, dropout)."""
    first = ins.get((0,))
    return Decision(first[1] if first else None)


def no_output(node: fx.Node, ins: Inputs, ctx: Context) -> Decision:
    """Checks with no output (``_assert_tensor_metadata``): any layout will do."""
    return Decision(None)


@on_split_input
def along_dim(node: fx.Node, ins: Inputs, ctx: Context, x: fx.Node, lay: Shard) -> Decision:
    """Ops that work along one dim and keep the shape (softmax, cumsum): fine unless it is the shard dim."""
    if _norm(arg_or_default(node, 1, "dim", 0), rank(x)) == lay.dim:
        return replicate_all(node, ins, ctx)
    return Decision(lay)


def _checks(shard: Shard, what: str) -> list[tuple[int, str]]:
    return [(s, what) for s in shard.segments]


@on_split_input
def reshape(node: fx.Node, ins: Inputs, ctx: Context, x: fx.Node, lay: Shard) -> Decision:
    """view/reshape/(un)squeeze/flatten: move the shard by shape algebra and fix the size constant."""
    new = map_reshape(sizes(x), sizes(node), lay, ctx.tp)
    if new is None:
        return replicate_all(node, ins, ctx)
    fixes = {}
    shape = node.args[1] if node.target in _SHAPE_ARG_OPS else None
    if shape is not None and isinstance(shape[new.dim], int) and shape[new.dim] != -1:
        fixes[(1, new.dim)] = shape[new.dim] // ctx.tp
    elif shape is not None and isinstance(shape[new.dim], fx.Node):
        fixes[(1, new.dim)] = DividedBy(ctx.tp)  # heads folded into the batch: ``B * H`` computed in the graph
    if node.target is aten.unflatten.int:  # (x, dim, sizes): the sizes replace dim
        index = new.dim - _norm(node.args[1], rank(x))
        if 0 <= index < len(node.args[2]) and isinstance(node.args[2][index], int) and node.args[2][index] != -1:
            fixes[(2, index)] = node.args[2][index] // ctx.tp
    shape = ", ".join(str(d) if isinstance(d, int) else "?" for d in sizes(node))
    return Decision(new, fixes=fixes, checks=_checks(new, f"dim {new.dim} of the reshape to ({shape})"))


@on_split_input
def expand(node: fx.Node, ins: Inputs, ctx: Context, x: fx.Node, lay: Shard) -> Decision:
    """expand: the sharded dim keeps its size; its entry in the size list becomes the local size."""
    out_dim = lay.dim + rank(node) - rank(x)
    size = node.args[1][out_dim]
    fixes = {(1, out_dim): size // ctx.tp} if isinstance(size, int) and size != -1 else {}
    return Decision(lay.moved(out_dim), fixes=fixes)


@on_split_input
def permute(node: fx.Node, ins: Inputs, ctx: Context, x: fx.Node, lay: Shard) -> Decision:
    """permute/transpose/t: follow the dim."""
    n = rank(x)
    if node.target is aten.permute.default:
        order = [_norm(d, n) for d in node.args[1]]
    else:
        d0, d1 = (0, 1) if node.target is aten.t.default else (_norm(node.args[1], n), _norm(node.args[2], n))
        order = list(range(n))
        order[d0], order[d1] = order[d1], order[d0]
    return Decision(lay.moved(order.index(lay.dim)))


def split(node: fx.Node, ins: Inputs, ctx: Context) -> Decision:
    """split/chunk/unbind: a split along the shard dim must cut exactly at segment boundaries."""
    x, lay = ins[(0,)]
    count = len(meta_val(node))
    if not isinstance(lay, Shard):
        return Decision(tuple(None for _ in range(count)))
    dim = _norm(arg_or_default(node, 2 if node.target is not aten.unbind.int else 1, "dim", 0), rank(x))
    if dim != lay.dim:
        moved = lay.moved(lay.dim - 1) if node.target is aten.unbind.int and dim < lay.dim else lay
        return Decision(tuple(moved for _ in range(count)))
    if node.target is aten.unbind.int:
        return _fused_hint(replicate_all(node, ins, ctx), lay)
    parts = tuple(int(v.shape[dim]) for v in meta_val(node))
    if parts != lay.segments:
        decision = replicate_all(node, ins, ctx)
        decision.hint = parts if sum(parts) == lay.size else None
        return decision
    fixes = {}
    if node.target is aten.split.Tensor:
        fixes[(1,)] = node.args[1] // ctx.tp
    elif node.target is aten.split_with_sizes.default:
        fixes[(1,)] = [s // ctx.tp for s in node.args[1]]
    return Decision(tuple(Shard(dim, (s,)) for s in parts), fixes=fixes)


def getitem(node: fx.Node, ins: Inputs, ctx: Context) -> Decision:
    """``out[i]`` of a multi-output op."""
    lay = ins[(0,)][1] if (0,) in ins else None  # absent: a whole multi-output value
    return Decision(lay[node.args[1]] if isinstance(lay, tuple) else lay)


@on_split_input
def slice_(node: fx.Node, ins: Inputs, ctx: Context, x: fx.Node, lay: Shard) -> Decision:
    """slice: fine off the shard dim, or when it keeps the whole shard dim, or every ``step``-th element of
    it (interleaved halves, ``x[..., ::2]``): each rank's part then holds its share of the result."""
    dim = _norm(arg_or_default(node, 1, "dim", 0), rank(x))
    start, end = arg_or_default(node, 2, "start", None), arg_or_default(node, 3, "end", None)
    step = arg_or_default(node, 4, "step", 1)
    if dim != lay.dim:
        return Decision(lay)
    start, end = (b + lay.size if isinstance(b, int) and b < 0 else b for b in (start, end))  # counted from the end
    whole_range = end is None or (isinstance(end, int) and end >= lay.size)
    if whole_range and (start or 0) == 0 and step == 1:
        return Decision(lay)
    if whole_range and isinstance(step, int) and 0 <= (start or 0) < step and all(s % step == 0 for s in lay.segments):
        strided = Shard(dim, tuple(s // step for s in lay.segments))
        return Decision(strided, checks=_checks(strided, f"every {step}th element along dim {dim}"))
    if step == 1 and isinstance(start or 0, int) and (end is None or isinstance(end, int)):
        return _segment_slice(node, ins, ctx, lay, start or 0, lay.size if whole_range else end)
    return replicate_all(node, ins, ctx)


def _segment_slice(node: fx.Node, ins: Inputs, ctx: Context, lay: Shard, start: int, end: int) -> Decision:
    """A slice of whole segments (Q, K or V of a fused projection) is those segments, at local offsets;
    a slice elsewhere asks for the projection to be split in segments cut where it cuts (the hint)."""
    bounds = [sum(lay.segments[:i]) for i in range(len(lay.segments) + 1)]
    if start in bounds and end in bounds and start < end:
        i, j = bounds.index(start), bounds.index(end)
        fixes = {(2,): start // ctx.tp} if start else {}
        if len(node.args) > 3 and node.args[3] is not None and end < lay.size:
            fixes[(3,)] = end // ctx.tp
        return Decision(Shard(lay.dim, lay.segments[i:j]), fixes=fixes)
    decision = replicate_all(node, ins, ctx)
    cuts = sorted(set(bounds) | {start, min(end, lay.size)})
    decision.hint = tuple(b - a for a, b in zip(cuts, cuts[1:]) if b > a)
    return decision


@on_split_input
def select(node: fx.Node, ins: Inputs, ctx: Context, x: fx.Node, lay: Shard) -> Decision:
    """select: drops a dim, which must not be the shard dim."""
    dim = _norm(node.args[1], rank(x))
    if dim == lay.dim:
        return _fused_hint(replicate_all(node, ins, ctx), lay)
    return Decision(lay.moved(lay.dim - (dim < lay.dim)))


def _fused_hint(decision: Decision, lay: Shard) -> Decision:
    """Picking one entry of a split dim (Q of ``qkv.unflatten(-1, (3, E))[..., 0, :]``): its projection is that
    many parts fused, each to be split on its own (the hint, in proportions the planner scales)."""
    if len(lay.segments) == 1 and static(lay.size) is not None and lay.size <= 16:
        decision.hint = (1,) * lay.size
    return decision


def cat(node: fx.Node, ins: Inputs, ctx: Context) -> Decision:
    """cat along a dim other than the shard dim (RoPE's rotate_half), or along it when every part is split
    there: each rank's parts side by side are its chunk of every part, the parts becoming segments (Q, K and V
    concatenated before a short convolution)."""
    sharded = _sharded(ins)
    if not sharded:
        return Decision(None)
    lays = {lay for _, _, lay in sharded}
    dim = _norm(arg_or_default(node, 1, "dim", 0), rank(node))
    if len(sharded) == len(ins) and all(lay.dim == dim and lay.blocks == 1 for lay in lays):
        parts = sorted(sharded, key=lambda item: item[0])
        return Decision(Shard(dim, tuple(s for _, _, lay in parts for s in lay.segments)))
    if len(lays) != 1 or dim == next(iter(lays)).dim:
        return replicate_all(node, ins, ctx)
    lay = lays.pop()
    return Decision(lay, wants=_join(node, ins, ctx, lay.dim, lay.segments))


def stack(node: fx.Node, ins: Inputs, ctx: Context) -> Decision:
    """stack into a new dim: the shard moves past it (interleaved rotary: ``stack((-x2, x1), -1).flatten(-2)``)."""
    sharded = _sharded(ins)
    if not sharded:
        return Decision(None)
    lays = {lay for _, _, lay in sharded}
    if len(lays) != 1:
        return replicate_all(node, ins, ctx)
    lay = lays.pop()
    dim = _norm(arg_or_default(node, 1, "dim", 0), rank(node))
    wants = {p: lay for p, (n, have) in ins.items() if not isinstance(have, Shard)}  # same shapes: sliced alike
    return Decision(lay.moved(lay.dim + (dim <= lay.dim)), wants=wants)


_ACROSS_SHARDS = {aten.sum.dim_IntList: Operator.G, aten.mean.dim: Operator.MEAN}
"""Reductions over the split dim that an all-reduce of the per-rank results completes (a norm's statistic:
RMSNorm's mean of squares over all heads is the average of the ranks' means, every shard being equal)."""


@on_split_input
def reduction(node: fx.Node, ins: Inputs, ctx: Context, x: fx.Node, lay: Shard) -> Decision:
    """sum/mean/amax/var/max over dims other than the shard dim; a sum or mean over it is all-reduced."""
    dims = arg_or_default(node, 1, "dim", None)
    if dims is None or dims == []:
        return replicate_all(node, ins, ctx)
    dims = [_norm(d, rank(x)) for d in ([dims] if isinstance(dims, int) else dims)]
    if lay.dim in dims:
        if node.target in _ACROSS_SHARDS and ctx.tp > 1 and lay.blocks == 1:
            return Decision(None, reduce=_ACROSS_SHARDS[node.target])
        return replicate_all(node, ins, ctx)
    keepdim = node.kwargs.get("keepdim", node.args[2] if len(node.args) > 2 and isinstance(node.args[2], bool) else False)
    out = lay if keepdim else lay.moved(lay.dim - sum(d < lay.dim for d in dims))
    return Decision((out, out) if _multi(node) else out)


def batched_matmul(node: fx.Node, ins: Inputs, ctx: Context) -> Decision:
    """matmul/bmm of activations (QKᵀ, attention·V): sharded along a batch dim (the heads)."""
    sharded = _sharded(ins)
    if not sharded:
        return Decision(None)
    if all(lay.dim < rank(n) - 2 for _, n, lay in sharded):
        return _aligned(node, ins, ctx, sharded)  # a batch dim (the heads)
    return _matrix_split(node, ins, ctx)


def baddbmm(node: fx.Node, ins: Inputs, ctx: Context) -> Decision:
    """``beta * input + alpha * (b1 @ b2)`` (scores plus an ALiBi bias, heads folded into the batch): split
    along the batch of the product, the added input joined to it."""
    sharded = _sharded(ins)
    if not sharded:
        return Decision(None)
    if any(p != (0,) and lay.dim != 0 for p, _, lay in sharded):
        return replicate_all(node, ins, ctx)
    return _aligned(node, ins, ctx, sharded)


@on_split_input
def layer_norm(node: fx.Node, ins: Inputs, ctx: Context, x: fx.Node, lay: Shard) -> Decision:
    """layer_norm over trailing dims other than the split one (a per-head QK norm): each rank normalises its own
    heads with the whole weight, whose gradient is then this rank's share (through ``f``)."""
    if lay.dim >= rank(x) - len(node.args[1]):
        return replicate_all(node, ins, ctx)
    return Decision(lay, wants={p: COPY if n.name in ctx.grad else None for p, (n, _) in ins.items() if p != (0,)})


@on_split_input
def repeat_interleave(node: fx.Node, ins: Inputs, ctx: Context, x: fx.Node, lay: Shard) -> Decision:
    """Each head repeated n times in place (grouped KV heads widened to the query heads): each rank's heads
    become its share of the repeated ones; along another dim, the split moves with it."""
    repeats, dim = node.args[1], arg_or_default(node, 2, "dim", None)
    if not isinstance(repeats, int) or dim is None:
        return replicate_all(node, ins, ctx)
    if _norm(dim, rank(x)) != lay.dim:
        return Decision(lay)
    return Decision(Shard(lay.dim, tuple(s * repeats for s in lay.segments), lay.blocks))


@on_split_input
def pad(node: fx.Node, ins: Inputs, ctx: Context, x: fx.Node, lay: Shard) -> Decision:
    """Padding of dims other than the split one (a sequence padded to whole chunks)."""
    amounts = node.args[1]  # (last dim's left, right, second-last's left, right, ...)
    padded = {rank(x) - 1 - i // 2 for i, a in enumerate(amounts) if a != 0}
    return replicate_all(node, ins, ctx) if lay.dim in padded else Decision(lay)


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


@on_split_input
def repeat(node: fx.Node, ins: Inputs, ctx: Context, x: fx.Node, lay: Shard) -> Decision:
    """repeat: the split dim must be repeated once (new leading dims only shift it)."""
    repeats = node.args[1]
    out_dim = lay.dim + len(repeats) - rank(x)
    return Decision(lay.moved(out_dim)) if repeats[out_dim] == 1 else replicate_all(node, ins, ctx)


@on_split_input
def view_as_complex(node: fx.Node, ins: Inputs, ctx: Context, x: fx.Node, lay: Shard) -> Decision:
    """view_as_complex drops the trailing pair dim (complex rotary); view_as_real adds one."""
    if node.target is aten.view_as_complex.default and lay.dim == rank(x) - 1:
        return replicate_all(node, ins, ctx)
    return Decision(lay)


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
        shard = la if contracted_a else lb
        if (contracted_a and lb not in (None, Shard(rb - 2, shard.segments))) or (contracted_b and la not in (None, Shard(ra - 1, shard.segments))):
            return replicate_all(node, ins, ctx)
        wants = {(1,): Shard(rb - 2, shard.segments)} if lb is None else {(0,): Shard(ra - 1, shard.segments)} if la is None else {}
        return Decision(None, wants=wants, reduce=Operator.G)
    if isinstance(la, Shard) and lb is None:  # rows of a
        return Decision(Shard(rank(node) - 2, la.segments), wants=whole)
    if isinstance(lb, Shard) and la is None:  # columns of b
        return Decision(Shard(rank(node) - 1, lb.segments), wants=whole)
    return replicate_all(node, ins, ctx)


@on_split_input
def index(node: fx.Node, ins: Inputs, ctx: Context, x: fx.Node, lay: Shard) -> Decision:
    """``x[idx]`` with one index tensor on dim 0 (rows picked per token: an expert's bias, a permutation): a
    split along a later dim stays, after the index's own dims."""
    indices = node.args[1]
    if len(indices) != 1 or not isinstance(indices[0], fx.Node) or lay.dim == 0:
        return replicate_all(node, ins, ctx)
    return Decision(lay.moved(lay.dim - 1 + rank(indices[0])), wants={p: None for p in ins if p != (0,)})


@on_split_input
def sym_size(node: fx.Node, ins: Inputs, ctx: Context, x: fx.Node, lay: Shard) -> Decision:
    """The size of a dim other than the split one is the same on every rank."""
    return Decision(None) if _norm(node.args[1], rank(x)) != lay.dim else replicate_all(node, ins, ctx)


def attention(node: fx.Node, ins: Inputs, ctx: Context) -> Decision:
    """scaled_dot_product_attention split by heads: the first of Q, K, V and the mask split by heads leads,
    the others follow it (sliced when whole; split any other way, inside a head, made so)."""
    q, _ = ins[(0,)]
    heads = rank(q) - 3
    leading = [ins[p][1] for p in ((0,), (1,), (2,), (3,)) if p in ins and isinstance(ins[p][1], Shard)
               and ins[p][1].dim == heads and rank(ins[p][0]) == rank(q)]  # a per-head bias shared by later layers may lead too
    if not leading:
        return replicate_all(node, ins, ctx) if _sharded(ins) else Decision(None)
    lay = leading[0]
    if arg_or_default(node, 7, "enable_gqa", False):
        # Each query head reads KV head h // (H / KV): contiguous chunks of both keep that on every rank.
        counts = [static(sizes(ins[p][0])[heads]) for p in ((0,), (1,), (2,))]
        if any(len(v[1].segments) != 1 for v in ins.values() if isinstance(v[1], Shard)) or \
                any(c is None or c % ctx.tp for c in counts):
            return replicate_all(node, ins, ctx)  # fewer KV heads than ranks: kept whole
        wants = {p: Shard(heads, (sizes(ins[p][0])[heads],)) for p in ((0,), (1,), (2,))}
        wants = {p: w for p, w in wants.items() if ins[p][1] != w}
        lay = Shard(heads, (sizes(q)[heads],))
        checks = [(c, "attention heads") for c in counts]
    else:
        wants = {p: Shard(heads, lay.segments) for p in ((0,), (1,), (2,)) if ins[p][1] != lay}
        checks = []
    mask = {p: v for p, v in ins.items() if p not in ((0,), (1,), (2,))}
    if any(isinstance(v[1], Shard) and v[1] != lay for v in mask.values()):
        return replicate_all(node, ins, ctx)
    wants |= _join(node, mask, ctx, heads, lay.segments)
    return Decision(lay, wants=wants, checks=checks)


@on_split_input
def conv1d(node: fx.Node, ins: Inputs, ctx: Context, x: fx.Node, lay: Shard) -> Decision:
    """A depthwise conv1d (one group per channel, as in Mamba's and short-conv mixers) with its channels
    split: each rank convolves its own channels with its rows of the weight; ``groups`` becomes local."""
    weight, _ = ins[(1,)]
    channels = sizes(x)[1] if rank(x) == 3 else None
    groups = arg_or_default(node, 6, "groups", 1)
    if lay.dim != 1 or groups != channels or sizes(weight)[0] != channels or sizes(weight)[1] != 1:
        return replicate_all(node, ins, ctx)
    others = [p for p in ins if p != (0,)]
    if any(isinstance(ins[p][1], Shard) and ins[p][1] != Shard(0, lay.segments) for p in others):
        return replicate_all(node, ins, ctx)
    wants = {p: Shard(0, lay.segments) for p in others if not isinstance(ins[p][1], Shard)}
    return Decision(lay, wants=wants, fixes={(6,): groups // ctx.tp}, checks=_checks(lay, "conv channels"))


def view_as(node: fx.Node, ins: Inputs, ctx: Context) -> Decision:
    """``x.view_as(y)``: a reshape to ``y``'s shape, which on each rank must be ``y``'s local shape."""
    x, lay = ins[(0,)]
    if not isinstance(lay, Shard):
        return replicate_all(node, ins, ctx) if _sharded(ins) else Decision(None)
    new = map_reshape(sizes(x), sizes(node), lay, ctx.tp)
    if new is None:
        return replicate_all(node, ins, ctx)
    return Decision(new, wants={(1,): new}, checks=_checks(new, "dims of view_as"))


_SHAPE_ARG_OPS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default}

RULES = {
    aten.view.default: reshape, aten.reshape.default: reshape, aten._unsafe_view.default: reshape,
    aten.unsqueeze.default: reshape, aten.squeeze.dim: reshape, aten.squeeze.dims: reshape,
    aten.squeeze.default: reshape, aten.flatten.using_ints: reshape, aten.unflatten.int: reshape,
    aten.expand.default: expand,
    aten.permute.default: permute, aten.transpose.int: permute, aten.t.default: permute,
    aten.split.Tensor: split, aten.split_with_sizes.default: split, aten.chunk.default: split,
    aten.unbind.int: split,
    operator.getitem: getitem,
    aten.slice.Tensor: slice_, aten.select.int: select, aten.cat.default: cat, aten.stack.default: stack,
    aten.softmax.int: along_dim, aten._softmax.default: along_dim, aten.log_softmax.int: along_dim,
    aten._log_softmax.default: along_dim, aten.cumsum.default: along_dim,
    aten.sum.dim_IntList: reduction, aten.mean.dim: reduction, aten.amax.default: reduction,
    aten.amin.default: reduction, aten.var.correction: reduction, aten.std.correction: reduction,
    aten.max.dim: reduction, aten.min.dim: reduction,
    aten.matmul.default: batched_matmul, aten.bmm.default: batched_matmul,
    aten.scaled_dot_product_attention.default: attention, aten.conv1d.default: conv1d,
    aten.view_as.default: view_as, aten.sym_size.int: sym_size, aten.index.Tensor: index, aten.repeat.default: repeat,
    aten.logsumexp.default: reduction, aten.copy_.default: copy_into, aten.tril.default: last_two_dims, aten.triu.default: last_two_dims, aten.pad.default: pad, aten.constant_pad_nd.default: pad, aten.repeat_interleave.self_int: repeat_interleave, aten.baddbmm.default: baddbmm, aten.layer_norm.default: layer_norm, aten.view_as_complex.default: view_as_complex,
    aten.view_as_real.default: view_as_complex,
    # pointwise, though not tagged so: a scalar on one side, or a 0-d tensor fill value
    aten.where.ScalarOther: pointwise, aten.where.ScalarSelf: pointwise, aten.where.Scalar: pointwise,
    aten.masked_fill.Tensor: pointwise,
    aten._assert_tensor_metadata.default: no_output,
}
for _op in (aten.to.dtype, aten.to.dtype_layout, aten.to.device, aten._to_copy.default, aten.contiguous.default,
            aten.detach.default, aten.alias.default, aten.dropout.default, aten.type_as.default,
            aten.lift_fresh_copy.default, aten.zeros_like.default, aten.ones_like.default, aten.empty_like.default,
            aten.full_like.default, aten.clone.default):
    RULES[_op] = like_first


BLOCK_AWARE = frozenset({reshape, permute, like_first, getitem, pointwise, batched_matmul, baddbmm, along_dim,
                         reduction, no_output})
"""The rules that keep a split repeated over blocks (``Shard.blocks``) meaningful; others see such inputs whole."""


def rule_for(target) -> callable:
    """The sharding rule of an op: its own, the pointwise rule for ops tagged pointwise, else replicate."""
    if target in RULES:
        return RULES[target]
    if isinstance(target, torch._ops.OpOverload) and torch.Tag.pointwise in target.tags:
        return pointwise
    return replicate_all
