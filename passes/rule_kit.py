"""What every sharding rule is made of: the ``Decision`` a rule returns, what it may consult, and the shared
pieces (the safe rule, the pointwise rule with broadcasting, joining whole inputs to a split one).

A rule is ``rule(node, ins, ctx) -> Decision``: given the layouts of an op's inputs, the layout of its output,
the layout it needs each input in (the propagation engine inserts the conversion when an input arrives
otherwise), the shape constants that must change on the shard, and the sizes that must divide by tp.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

from autotp.passes.graph import ArgPath, is_tensor, meta_val, rank, sizes
from autotp.passes.placement import Layout, Shard
from autotp.passes.reshapes import broadcast_dim
from autotp.passes.steps import COPY, Operator, Step
from torch import fx


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


def norm_dim(dim: int, ndim: int) -> int:
    return dim + ndim if dim < 0 else dim


def sharded_inputs(ins: Inputs) -> list[tuple[ArgPath, fx.Node, Shard]]:
    return [(p, n, lay) for p, (n, lay) in ins.items() if isinstance(lay, Shard)]


def multi_output(node: fx.Node) -> bool:
    return isinstance(meta_val(node), (tuple, list))


def on_split_input(rule):
    """For a rule about its first input split along one dim: a whole first input gives a whole output, from
    whole inputs (``dst.copy_(src)`` into a whole ``dst`` gathers a split ``src`` first).

    The wrapped rule is called as ``rule(node, ins, ctx, x, layout)`` with the first input and its Shard.
    """
    @functools.wraps(rule)
    def checked(node: fx.Node, ins: Inputs, ctx: Context) -> Decision:
        x, lay = ins[(0,)]
        if not isinstance(lay, Shard):
            return replicate_all(node, ins, ctx)
        return rule(node, ins, ctx, x, lay)
    return checked


def replicate_all(node: fx.Node, ins: Inputs, ctx: Context) -> Decision:
    """The safe rule: the op sees full tensors and produces full tensors."""
    out = tuple(None for _ in meta_val(node)) if multi_output(node) else None
    return Decision(out, wants={p: None for p in ins})


def join(node: fx.Node, ins: Inputs, ctx: Context, out_dim: int, segments: tuple[int, ...],
          skip: set = frozenset(), blocks: object = 1, replicas: int = 1) -> dict:
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
            wants[p] = Shard(d, segments, blocks, replicas)
    return wants


def pointwise(node: fx.Node, ins: Inputs, ctx: Context) -> Decision:
    """Elementwise ops with broadcasting: all sharded inputs must agree on the output dim."""
    sharded = sharded_inputs(ins)
    if not sharded:
        return Decision(None)
    return aligned(node, ins, ctx, sharded)


def aligned(node: fx.Node, ins: Inputs, ctx: Context, sharded) -> Decision:
    """The output split where every sharded input's split lands (aligned from the right, as broadcasting
    aligns dims), the other inputs joined to it; replicated when the inputs disagree."""
    out_rank = rank(node)
    targets = {(lay.dim + out_rank - rank(n), lay.segments, lay.blocks, lay.replicas, lay.spread)
               for _, n, lay in sharded}
    if len(targets) != 1:
        return replicate_all(node, ins, ctx)
    out_dim, segments, blocks, replicas, spread = targets.pop()
    if spread:
        return replicate_all(node, ins, ctx)  # spread chunks are only ever merged by the reshape that follows
    return Decision(Shard(out_dim, segments, blocks, replicas),
                    wants=join(node, ins, ctx, out_dim, segments, blocks=blocks, replicas=replicas))


def like_first(node: fx.Node, ins: Inputs, ctx: Context) -> Decision:
    """Ops whose output is laid out like their first input (casts, copies, dropout)."""
    first = ins.get((0,))
    return Decision(first[1] if first else None)


def no_output(node: fx.Node, ins: Inputs, ctx: Context) -> Decision:
    """Checks with no output (``_assert_tensor_metadata``): any layout will do."""
    return Decision(None)


def size_checks(shard: Shard, what: str) -> list[tuple[int, str]]:
    """Each segment must divide into the shard's chunks: by tp, or by tp // replicas (checked as s * replicas)."""
    return [(s * shard.replicas, what) for s in shard.segments]
