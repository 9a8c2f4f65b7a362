"""Sharding rules of ops that move data without computing on it: reshapes, transposes, slices, selects, cat and
stack, indexing, repeats, padding. They move a split to where it lands, or see their input whole."""

from __future__ import annotations

import dataclasses
import sys

import sympy
import torch
from autotp.passes.graph import DividedBy, arg_or_default, chunk_size, meta_val, rank, sizes
from autotp.passes.placement import Shard
from autotp.passes.reshapes import map_reshape, static
from autotp.passes.rule_kit import (
    Context,
    Decision,
    Inputs,
    join,
    norm_dim,
    on_split_input,
    replicate_all,
    sharded_inputs,
    size_checks,
)
from torch import fx

aten = torch.ops.aten


_SHAPE_ARG_OPS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default}


@on_split_input
def reshape(node: fx.Node, ins: Inputs, ctx: Context, x: fx.Node, lay: Shard) -> Decision:
    """view/reshape/(un)squeeze/flatten: move the shard by shape algebra and fix the size constant."""
    new = map_reshape(sizes(x), sizes(node), lay, ctx.tp)
    if new is None:
        return replicate_all(node, ins, ctx)
    fixes = {}
    shape = node.args[1] if node.target in _SHAPE_ARG_OPS else None
    chunks = new.chunks(ctx.tp)
    if shape is not None and isinstance(shape[new.dim], int) and shape[new.dim] != -1:
        fixes[(1, new.dim)] = chunk_size(shape[new.dim], chunks)
    elif shape is not None and isinstance(shape[new.dim], fx.Node):
        fixes[(1, new.dim)] = DividedBy(chunks)  # heads folded into the batch: ``B * H`` computed in the graph
    if node.target is aten.unflatten.int:  # (x, dim, sizes): the sizes replace dim
        index = new.dim - norm_dim(node.args[1], rank(x))
        if 0 <= index < len(node.args[2]) and isinstance(node.args[2][index], int) and node.args[2][index] != -1:
            fixes[(2, index)] = chunk_size(node.args[2][index], chunks)
    shape = ", ".join(str(d) if isinstance(d, int) else "?" for d in sizes(node))
    what = f"dim {new.dim} of the reshape to ({shape})"
    parts = len(new.segments) if len(new.segments) > 1 else new.blocks if isinstance(new.blocks, int) else 1
    if parts != 1:  # the sizes checked are one part's each, not the dim's: say so
        what += f" per part (it holds {parts} parts side by side, each split alike)"
    return Decision(new, fixes=fixes, checks=size_checks(new, what))


@on_split_input
def expand(node: fx.Node, ins: Inputs, ctx: Context, x: fx.Node, lay: Shard) -> Decision:
    """expand: the sharded dim keeps its size; its entry in the size list becomes the local size. A chunk several
    ranks hold, expanded along the next dim (a KV head repeated for its query heads), is spread over them there."""
    shape, offset = node.args[1], rank(node) - rank(x)
    out_dim = lay.dim + offset
    size, fixes = shape[out_dim], {}
    if isinstance(size, int) and size != -1:
        fixes[(1, out_dim)] = chunk_size(size, lay.chunks(ctx.tp))
    elif isinstance(size, fx.Node):
        fixes[(1, out_dim)] = DividedBy(lay.chunks(ctx.tp))  # a sequence split: its size is computed
    out = lay.moved(out_dim)
    after = out_dim + 1
    if (lay.replicas != 1 and not lay.spread and after < len(shape) and sizes(x)[after - offset] == 1
            and isinstance(shape[after], int) and shape[after] > 1 and shape[after] % lay.replicas == 0):
        fixes[(1, after)] = shape[after] // lay.replicas
        out = dataclasses.replace(out, spread=True)
    return Decision(out, fixes=fixes)


def permutation(node: fx.Node) -> list[int]:
    """The input dim each output dim of a permute/transpose/t comes from."""
    n = rank(node)
    if node.target is aten.permute.default:
        return [norm_dim(d, n) for d in node.args[1]]
    if node.target is aten.numpy_T.default:  # ``W.T``: every dim reversed
        return list(reversed(range(n)))
    d0, d1 = (0, 1) if node.target is aten.t.default else (norm_dim(node.args[1], n), norm_dim(node.args[2], n))
    order = list(range(n))
    order[d0], order[d1] = order[d1], order[d0]
    return order


@on_split_input
def permute(node: fx.Node, ins: Inputs, ctx: Context, x: fx.Node, lay: Shard) -> Decision:
    """permute/transpose/t: follow the dim."""
    return Decision(lay.moved(permutation(node).index(lay.dim)))


def split(node: fx.Node, ins: Inputs, ctx: Context) -> Decision:
    """split/chunk/unbind: a split along the shard dim must cut exactly at segment boundaries."""
    x, lay = ins[(0,)]
    count = len(meta_val(node))
    if not isinstance(lay, Shard):
        return Decision(tuple(None for _ in range(count)))
    dim = norm_dim(arg_or_default(node, 2 if node.target is not aten.unbind.int else 1, "dim", 0), rank(x))
    if dim != lay.dim:
        moved = lay.moved(lay.dim - 1) if node.target is aten.unbind.int and dim < lay.dim else lay
        return Decision(tuple(moved for _ in range(count)))
    if lay.replicas != 1:
        return replicate_all(node, ins, ctx)
    if node.target is aten.unbind.int:
        return _fused_hint(replicate_all(node, ins, ctx), lay)
    parts = tuple(int(v.shape[dim]) for v in meta_val(node))
    grouped = _segments_per_part(parts, lay.segments)
    if grouped is None:
        decision = replicate_all(node, ins, ctx)
        decision.hint = parts if sum(parts) == lay.size else None
        return decision
    fixes = {}
    if node.target is aten.split.Tensor:
        fixes[(1,)] = _local_size(node.args[1], ctx.tp)
    elif node.target is aten.split_with_sizes.default:
        fixes.update({(1, i): _local_size(s, ctx.tp) for i, s in enumerate(node.args[1])})
    return Decision(tuple(Shard(dim, g) for g in grouped), fixes=fixes)


def _segments_per_part(parts: tuple[int, ...], segments: tuple[int, ...]) -> tuple[tuple[int, ...], ...] | None:
    """The segments inside each part of a split (Q's, then K's and V's of a packed ``[E, 2E]`` split), or None
    when a cut falls inside a segment."""
    out, at = [], 0
    for part in parts:
        inside, total = [], 0
        while at < len(segments) and total < part:
            inside.append(segments[at])
            total, at = total + segments[at], at + 1
        if total != part:
            return None
        out.append(tuple(inside))
    return tuple(out) if at == len(segments) else None


def _local_size(size: int | fx.Node, tp: int) -> int | DividedBy:
    """A split size's value on each rank: a constant divided now, a size the graph computes (channels read off
    a symbolic shape) divided where it is read."""
    return DividedBy(tp) if isinstance(size, fx.Node) else size // tp


def getitem(node: fx.Node, ins: Inputs, ctx: Context) -> Decision:
    """``out[i]`` of a multi-output op."""
    lay = ins[(0,)][1] if (0,) in ins else None  # absent: a whole multi-output value
    return Decision(lay[node.args[1]] if isinstance(lay, tuple) else lay)


@on_split_input
def slice_(node: fx.Node, ins: Inputs, ctx: Context, x: fx.Node, lay: Shard) -> Decision:
    """slice: fine off the shard dim, or when it keeps the whole shard dim, or every ``step``-th element of
    it (interleaved halves, ``x[..., ::2]``): each rank's part then holds its share of the result."""
    dim = norm_dim(arg_or_default(node, 1, "dim", 0), rank(x))
    start, end = arg_or_default(node, 2, "start", None), arg_or_default(node, 3, "end", None)
    step = arg_or_default(node, 4, "step", 1)
    if dim != lay.dim:
        return Decision(lay)
    if lay.replicas != 1 and (step != 1 or static(lay.size) is None):
        return replicate_all(node, ins, ctx)  # chunks several ranks hold: only whole segments are taken apart
    if static(lay.size) is None:  # split along the sequence: only a slice keeping all of it keeps the split
        everything = start in (None, 0) and step == 1 and end in (None, sys.maxsize)
        return Decision(lay) if everything else replicate_all(node, ins, ctx)
    start = 0 if start is None else start
    start, end = (b + lay.size if isinstance(b, int) and b < 0 else b for b in (start, end))  # counted from the end
    if not (isinstance(start, int) and isinstance(step, int) and (end is None or isinstance(end, int))):
        return replicate_all(node, ins, ctx)
    end = lay.size if end is None else min(end, lay.size)
    if step == 1:
        return Decision(lay) if (start, end) == (0, lay.size) else _segment_slice(node, ins, ctx, lay, start, end)
    if end == lay.size and 0 <= start < step and all(s % step == 0 for s in lay.segments):
        strided = Shard(dim, tuple(s // step for s in lay.segments))
        return Decision(strided, checks=size_checks(strided, f"every {step}th element along dim {dim}"))
    return replicate_all(node, ins, ctx)


def _segment_slice(node: fx.Node, ins: Inputs, ctx: Context, lay: Shard, start: int, end: int) -> Decision:
    """A slice of whole segments (Q, K or V of a fused projection) is those segments, at local offsets (held by
    as many ranks as the value's chunks are); a slice elsewhere asks for the projection to be split in segments
    cut where it cuts (the hint)."""
    bounds = [sum(lay.segments[:i]) for i in range(len(lay.segments) + 1)]
    if start in bounds and end in bounds and start < end:
        i, j = bounds.index(start), bounds.index(end)
        chunks = lay.chunks(ctx.tp)
        fixes = {(2,): start // chunks} if start else {}
        if len(node.args) > 3 and node.args[3] is not None and end < lay.size:
            fixes[(3,)] = end // chunks
        return Decision(Shard(lay.dim, lay.segments[i:j], replicas=lay.replicas), fixes=fixes)
    decision = replicate_all(node, ins, ctx)
    cuts = sorted(set(bounds) | {start, end})
    decision.hint = tuple(b - a for a, b in zip(cuts, cuts[1:]) if b > a)
    return decision


@on_split_input
def select(node: fx.Node, ins: Inputs, ctx: Context, x: fx.Node, lay: Shard) -> Decision:
    """select: drops a dim, which must not be the shard dim."""
    dim = norm_dim(node.args[1], rank(x))
    if dim == lay.dim:
        return _fused_hint(replicate_all(node, ins, ctx), lay)
    return Decision(lay.moved(lay.dim - (dim < lay.dim)))


@on_split_input
def index_select(node: fx.Node, ins: Inputs, ctx: Context, x: fx.Node, lay: Shard) -> Decision:
    """``x.index_select(dim, ids)`` along another dim than the split one (XLNet's relative shift picks key
    positions of split heads): each rank picks from its own slice; the ids stay whole."""
    if norm_dim(node.args[1], rank(x)) == lay.dim:
        return replicate_all(node, ins, ctx)
    return Decision(lay, wants={p: None for p in ins if p != (0,)})


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
    # an empty 1-D part is skipped by torch.cat whatever the others' ranks (a transformers cache's first keys):
    # any layout will do for it, and every rank skips it alike
    ins = {p: (n, lay) for p, (n, lay) in ins.items() if not _skipped_by_cat(n, node)}
    sharded = sharded_inputs(ins)
    if not sharded:
        return Decision(None)
    lays = {lay for _, _, lay in sharded}
    if any(rank(n) != rank(node) for n, _ in ins.values()):
        return replicate_all(node, ins, ctx)
    dim = norm_dim(arg_or_default(node, 1, "dim", 0), rank(node))
    # a whole part no gradient reaches (BEiT's zero key bias between split query and value biases) is sliced
    # for free, as if split there
    free = {p: Shard(dim, (sizes(n)[dim],)) for p, (n, lay) in ins.items() if lay is None and n.name not in ctx.grad}
    if len(sharded) + len(free) == len(ins) and all(lay.dim == dim and lay.blocks == 1 and lay.replicas == 1
                                                    for lay in lays):
        parts = sorted([(p, lay) for p, _, lay in sharded] + list(free.items()), key=lambda item: item[0])
        checks = [c for lay in free.values() for c in size_checks(lay, "a concatenated part sliced per rank")]
        return Decision(Shard(dim, tuple(s for _, lay in parts for s in lay.segments)), wants=free, checks=checks)
    if len(lays) != 1 or dim == next(iter(lays)).dim:
        return replicate_all(node, ins, ctx)
    lay = lays.pop()
    return Decision(lay, wants=join(node, ins, ctx, lay.dim, lay.segments, replicas=lay.replicas))


def _skipped_by_cat(part: fx.Node, node: fx.Node) -> bool:
    """Whether ``part`` is an empty 1-D tensor concatenated with tensors of more dims, which torch.cat skips."""
    return rank(part) == 1 and rank(node) != 1 and sizes(part)[0] == 0


def stack(node: fx.Node, ins: Inputs, ctx: Context) -> Decision:
    """stack into a new dim: the shard moves past it (interleaved rotary: ``stack((-x2, x1), -1).flatten(-2)``)."""
    sharded = sharded_inputs(ins)
    if not sharded:
        return Decision(None)
    lays = {lay for _, _, lay in sharded}
    if len(lays) != 1:
        return replicate_all(node, ins, ctx)
    lay = lays.pop()
    dim = norm_dim(arg_or_default(node, 1, "dim", 0), rank(node))
    wants = {p: lay for p, (n, have) in ins.items() if not isinstance(have, Shard)}  # same shapes: sliced alike
    return Decision(lay.moved(lay.dim + (dim <= lay.dim)), wants=wants)


@on_split_input
def repeat_interleave(node: fx.Node, ins: Inputs, ctx: Context, x: fx.Node, lay: Shard) -> Decision:
    """Each head repeated n times in place (grouped KV heads widened to the query heads): each rank's heads
    become its share of the repeated ones; along another dim, the split moves with it."""
    repeats, dim = node.args[1], arg_or_default(node, 2, "dim", None)
    if not isinstance(repeats, int) or dim is None:
        return replicate_all(node, ins, ctx)
    if norm_dim(dim, rank(x)) != lay.dim:
        return Decision(lay)
    return Decision(Shard(lay.dim, tuple(s * repeats for s in lay.segments), lay.blocks))


@on_split_input
def pad(node: fx.Node, ins: Inputs, ctx: Context, x: fx.Node, lay: Shard) -> Decision:
    """Padding of dims other than the split one (a sequence padded to whole chunks)."""
    amounts = node.args[1]  # (last dim's left, right, second-last's left, right, ...)
    padded = {rank(x) - 1 - i // 2 for i, a in enumerate(amounts) if a != 0}
    return replicate_all(node, ins, ctx) if lay.dim in padded else Decision(lay)


@on_split_input
def repeat(node: fx.Node, ins: Inputs, ctx: Context, x: fx.Node, lay: Shard) -> Decision:
    """repeat: new leading dims only shift the split; the split dim repeated n times holds n consecutive copies,
    each split alike (``Shard.blocks``: a per-head position table repeated over the batch, as heads folded into
    the batch are laid out)."""
    out_dim = lay.dim + len(node.args[1]) - rank(x)
    blocks = repeat_blocks(node, lay)
    if blocks is None:
        return replicate_all(node, ins, ctx)
    return Decision(dataclasses.replace(lay, dim=out_dim, blocks=blocks))


def repeat_blocks(node: fx.Node, lay: Shard):
    """The blocks of ``repeat``'s output split as its input's ``lay`` (1 when that dim is not repeated), or None
    when a split already repeated over blocks, or held by several ranks, would be repeated again."""
    repeats = node.args[1]
    out_dim = lay.dim + len(repeats) - rank(node.args[0])
    if isinstance(repeats[out_dim], int) and repeats[out_dim] == 1:
        return lay.blocks
    if lay.blocks != 1 or lay.replicas != 1 or lay.spread:
        return None
    return sympy.simplify(sympy.sympify(sizes(node)[out_dim]) / lay.size)


@on_split_input
def view_as_complex(node: fx.Node, ins: Inputs, ctx: Context, x: fx.Node, lay: Shard) -> Decision:
    """view_as_complex drops the trailing pair dim (complex rotary); view_as_real adds one."""
    if node.target is aten.view_as_complex.default and lay.dim == rank(x) - 1:
        return replicate_all(node, ins, ctx)
    return Decision(lay)


@on_split_input
def index(node: fx.Node, ins: Inputs, ctx: Context, x: fx.Node, lay: Shard) -> Decision:
    """``x[idx]`` with one index tensor on dim 0 (rows picked per token: an expert's bias, a permutation): a
    split along a later dim stays, after the index's own dims."""
    indices = node.args[1]
    if len(indices) != 1 or not isinstance(indices[0], fx.Node) or lay.dim == 0:
        return replicate_all(node, ins, ctx)
    return Decision(lay.moved(lay.dim - 1 + rank(indices[0])), wants={p: None for p in ins if p != (0,)})


def gather(node: fx.Node, ins: Inputs, ctx: Context) -> Decision:
    """``x.gather(dim, index)`` with ``x`` split along another dim (a relative-position bias picked per bucket,
    split by heads; DeBERTa's content-to-position scores picked per relative distance, heads folded into the
    batch): each rank gathers within its own slice, the index (the output's shape) sliced alike."""
    (_, lay), (_, ids_lay) = ins[(0,)], ins[(2,)]
    if not isinstance(lay, Shard) or not gathers_within(node, lay):
        return replicate_all(node, ins, ctx) if sharded_inputs(ins) else Decision(None)
    if ids_lay not in (None, lay):
        return replicate_all(node, ins, ctx)
    return Decision(lay, wants={(2,): lay} if ids_lay is None else {})


def gathers_within(node: fx.Node, lay: Shard) -> bool:
    """Whether ``gather`` along its dim keeps ``lay``'s split (another dim, as large in the index)."""
    x, dim, ids = node.args[0], node.args[1], node.args[2]
    return (norm_dim(dim, rank(x)) != lay.dim and rank(ids) == rank(x) and sizes(ids)[lay.dim] == sizes(x)[lay.dim])


@on_split_input
def sym_size(node: fx.Node, ins: Inputs, ctx: Context, x: fx.Node, lay: Shard) -> Decision:
    """The size of a dim other than the split one is the same on every rank."""
    return Decision(None) if norm_dim(node.args[1], rank(x)) != lay.dim else replicate_all(node, ins, ctx)


def view_as(node: fx.Node, ins: Inputs, ctx: Context) -> Decision:
    """``x.view_as(y)``: a reshape to ``y``'s shape, which on each rank must be ``y``'s local shape."""
    x, lay = ins[(0,)]
    if not isinstance(lay, Shard):
        return replicate_all(node, ins, ctx) if sharded_inputs(ins) else Decision(None)
    new = map_reshape(sizes(x), sizes(node), lay, ctx.tp)
    if new is None:
        return replicate_all(node, ins, ctx)
    return Decision(new, wants={(1,): new}, checks=size_checks(new, "dims of view_as"))


def new_filled(node: fx.Node, ins: Inputs, ctx: Context) -> Decision:
    """``x.new_empty(size)`` (and new_zeros/ones/full): a fresh tensor of a given size that reads only ``x``'s
    dtype and device. When ``x`` is split and the new tensor has its shape along the split dim (keys made by
    filling a ``new_empty`` like the value heads, as low-rank attention does), each rank makes its own part:
    the size constant there becomes the local size. Otherwise it is made whole; ``x`` never needs gathering."""
    x, lay = ins[(0,)]
    shape = node.args[1]
    if not isinstance(lay, Shard) or lay.blocks != 1 or lay.replicas != 1 or len(shape) != rank(x):
        return Decision(None)
    size = shape[lay.dim]
    if not isinstance(size, int) or size != lay.size:
        return Decision(None)
    return Decision(lay, fixes={(1, lay.dim): chunk_size(size, lay.chunks(ctx.tp))},
                    checks=size_checks(lay, f"dim {lay.dim} of the new tensor"))
