"""The communication vocabulary: conversion steps on graph edges and the collectives they become.

A ``Step`` is what sharding propagation asks for on an edge (make a split value whole, pass a whole
value through Megatron's ``f``, keep this rank's slice of a whole value). Every communication the
rewrite inserts has an ``Operator`` (Megatron's name for it), and ``COMMUNICATION`` is the one table
from an operator to the collectives it runs and the pass each runs in. The planner lists collectives
from it, the report and the pictures describe them with it; the rewriter keys its autograd modules
by the same ``Operator`` (``autotp.rewrite.collectives.IMPLEMENTATIONS``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from enum import Enum

from autotp.passes.placement import Layout, Shard


class Operator(str, Enum):
    """Megatron's name for a communication boundary."""

    F = "f"
    """Copy into a tensor-parallel region: identity forward, all-reduce of the gradient backward."""
    G = "g"
    """Reduce out of a region (after a row-split projection): all-reduce forward, identity backward."""
    GATHER = "gather"
    """Make a split value whole: all-gather forward, keep this rank's slice of the gradient backward."""
    SCATTER = "scatter"
    """Keep this rank's slice of a whole value: slice forward, all-gather of the gradient backward."""
    VOCAB_EMBEDDING = "vocab_embedding"
    """Sum the partial lookups of a vocabulary-split embedding: all-reduce forward."""
    MEAN = "mean"
    """Average the ranks' means over their shares of a split dim (a norm's statistic): all-reduce forward."""
    REDUCE_SCATTER = "reduce_scatter"
    """Sequence parallelism's ``g``: sum the ranks' partial results and keep this rank's part of the sequence
    (reduce-scatter forward, all-gather of the gradient backward); after a row-split projection or a split lookup."""
    GATHER_TO_REGION = "gather_to_region"
    """A gather, then ``f``, fused (sequence parallelism's way into a column-split region): all-gather forward,
    reduce-scatter of the gradient backward (half the bytes of ``f``'s all-reduce)."""
    NARROW = "narrow"
    """Keep this rank's part of a chunk it holds with other ranks (``Shard.replicas``), the part a plain split
    gives it: slice forward, no communication; backward, the gradient in that part and zeros in the rest of the
    chunk (each holder's share, which the holders' sum makes whole)."""
    SHARED_GRAD = "shared_grad"
    """A parameter chunk several ranks hold (grouped-query attention's KV heads above their count): identity
    forward; backward, the holders' gradient shares summed (all-gather of the shares)."""
    CROSS_ENTROPY = "cross_entropy"
    """Cross-entropy of class-split logits: each rank's max, sum of exponentials and target logit, all-gathered
    forward (Megatron's vocab-parallel cross-entropy; backward local)."""
    ONCE = "once"
    """A whole value added to a partial sum (an expert's bias before the router's weight): itself on the first
    rank, zeros on the others, so the sum over the ranks adds it once; no communication (its gradient, the sum's,
    is whole on every rank: identity backward)."""
    DISPATCH = "dispatch"
    """Expert parallelism's dispatch: each rank's routed rows to the ranks holding their experts (all-to-all of
    variable sizes forward, the reverse all-to-all of their gradient backward)."""
    COMBINE = "combine"
    """Expert parallelism's combine: the experts' results back to the ranks the rows came from (all-to-all forward,
    the reverse all-to-all of their gradient backward)."""
    ROUTE = "route"
    """The rows each rank routes to each expert, all-gathered over the expert-parallel ranks (the all-to-alls'
    sizes, a few integers); forward only."""
    RUNNING_STATS = "running_stats"
    """A batch norm of channels split, in training: each rank updates its channels' running mean and variance,
    all-gathered forward into the whole buffers every rank keeps (no gradient flows through them)."""
    GRAD_SUM = "grad_sum"
    """A whole parameter of which each rank computes only a share of the gradient (a low-rank adapter's whole
    matrix beside a split base layer): identity forward; backward, the shares of all such parameters are summed in
    one bucketed all-reduce at the end of the backward (Megatron's ``finalize_model_grads`` for replicated
    parameters), not one all-reduce each."""


class CollectiveOp(str, Enum):
    """The torch.distributed collective an operator runs."""

    ALL_REDUCE = "all_reduce"
    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_TO_ALL = "all_to_all"


def ring_share(op: CollectiveOp, tp: int) -> float:
    """What each rank sends for ``op`` over a ring of ``tp`` ranks, as a fraction of the payload (the collective's
    whole tensor): an all-reduce is a reduce-scatter and an all-gather, 2(tp-1)/tp; either alone (tp-1)/tp."""
    return (2 if op is CollectiveOp.ALL_REDUCE else 1) * (tp - 1) / tp


class Direction(str, Enum):
    """The pass in which a collective runs."""

    FORWARD = "forward"
    BACKWARD = "backward"


@dataclass(frozen=True)
class Communication:
    """What an operator does on the wire, and where a listing should place it."""

    op: CollectiveOp
    direction: Direction
    at_source: bool
    """Listed at the value it converts (a gather), rather than at the value's reader (``f``, a slice)."""


COMMUNICATION: dict[Operator, tuple[Communication, ...]] = {
    Operator.F: (Communication(CollectiveOp.ALL_REDUCE, Direction.BACKWARD, at_source=False),),
    Operator.G: (Communication(CollectiveOp.ALL_REDUCE, Direction.FORWARD, at_source=True),),
    Operator.GATHER: (Communication(CollectiveOp.ALL_GATHER, Direction.FORWARD, at_source=True),),
    Operator.SCATTER: (Communication(CollectiveOp.ALL_GATHER, Direction.BACKWARD, at_source=False),),
    Operator.VOCAB_EMBEDDING: (Communication(CollectiveOp.ALL_REDUCE, Direction.FORWARD, at_source=True),),
    Operator.MEAN: (Communication(CollectiveOp.ALL_REDUCE, Direction.FORWARD, at_source=True),),
    Operator.REDUCE_SCATTER: (Communication(CollectiveOp.REDUCE_SCATTER, Direction.FORWARD, at_source=True),
                              Communication(CollectiveOp.ALL_GATHER, Direction.BACKWARD, at_source=True)),
    Operator.GATHER_TO_REGION: (Communication(CollectiveOp.ALL_GATHER, Direction.FORWARD, at_source=True),
                                Communication(CollectiveOp.REDUCE_SCATTER, Direction.BACKWARD, at_source=True)),
    Operator.NARROW: (),
    Operator.ONCE: (),
    Operator.SHARED_GRAD: (Communication(CollectiveOp.ALL_GATHER, Direction.BACKWARD, at_source=True),),
    Operator.CROSS_ENTROPY: (Communication(CollectiveOp.ALL_GATHER, Direction.FORWARD, at_source=True),),
    Operator.DISPATCH: (Communication(CollectiveOp.ALL_TO_ALL, Direction.FORWARD, at_source=True),
                        Communication(CollectiveOp.ALL_TO_ALL, Direction.BACKWARD, at_source=True)),
    Operator.COMBINE: (Communication(CollectiveOp.ALL_TO_ALL, Direction.FORWARD, at_source=True),
                       Communication(CollectiveOp.ALL_TO_ALL, Direction.BACKWARD, at_source=True)),
    Operator.ROUTE: (Communication(CollectiveOp.ALL_GATHER, Direction.FORWARD, at_source=True),),
    Operator.RUNNING_STATS: (Communication(CollectiveOp.ALL_GATHER, Direction.FORWARD, at_source=True),),
    Operator.GRAD_SUM: (),  # one bucket for all of them, listed once (planning.planned_collectives)
}


@dataclass(frozen=True)
class Step:
    """One conversion on an edge: ``F`` (no shard), or ``GATHER``/``SCATTER``/``NARROW`` of ``shard``."""

    operator: Operator
    shard: Shard | None = None

    def __post_init__(self):
        if self.operator not in CONVERSIONS:
            raise ValueError(f"{self.operator} is not a conversion step (one of {sorted(CONVERSIONS)})")
        if (self.shard is None) != (self.operator in (Operator.F, Operator.ONCE, Operator.GRAD_SUM)):
            raise ValueError(f"step {self.operator.value} needs a shard iff it gathers or slices, got {self.shard}")


CONVERSIONS = frozenset({Operator.F, Operator.GATHER, Operator.SCATTER, Operator.GATHER_TO_REGION, Operator.NARROW,
                         Operator.ONCE, Operator.GRAD_SUM})
"""The operators that convert a value on an edge (the others reduce a node's own output)."""

COPY = Step(Operator.F)
"""Pass a whole value through ``f``: its reader sees only this rank's share of the gradient."""

ONCE = Step(Operator.ONCE)
"""Add a whole value to a partial sum on one rank only (``Operator.ONCE``)."""

GRAD_SUM = Step(Operator.GRAD_SUM)
"""Read a whole parameter whose gradient each rank computes a share of, the shares summed in the end-of-backward
bucket (``Operator.GRAD_SUM``)."""


def gather(shard: Shard) -> Step:
    """Make a value split as ``shard`` whole."""
    return Step(Operator.GATHER, shard)


def scatter(shard: Shard) -> Step:
    """Keep this rank's part (as ``shard``) of a whole value."""
    return Step(Operator.SCATTER, shard)


def narrow(shard: Shard) -> Step:
    """Keep this rank's part, as a plain split (``replicas`` 1), of a value split as ``shard``, whose chunks
    several ranks hold."""
    return Step(Operator.NARROW, shard)


def narrows(have, want) -> bool:
    """Whether ``want`` is ``have``'s plain split, which ``narrow`` reaches without communication: ``have`` a
    chunk several ranks hold (not spread, not in blocks), ``want`` the same split with one rank per chunk."""
    return (isinstance(have, Shard) and isinstance(want, Shard) and have.replicas != 1 and not have.spread
            and have.blocks == 1 and want == dataclasses.replace(have, replicas=1))


def fused(steps: tuple[Step, ...]) -> tuple[Step, ...]:
    """``steps`` as the rewrite runs them: a gather followed by ``f`` becomes one ``GATHER_TO_REGION``, whose
    backward reduce-scatters the gradient instead of all-reducing it and keeping a slice. Propagation records
    the two steps apart (the region search looks for gathers); the rewrite and the plan's listing fuse them."""
    out: list[Step] = []
    for step in steps:
        if step == COPY and out and out[-1].operator is Operator.GATHER and out[-1].shard.replicas == 1:
            out[-1] = Step(Operator.GATHER_TO_REGION, out[-1].shard)
        else:
            out.append(step)
    return tuple(out)


def steps_between(have: Layout, want: Layout | Step) -> tuple[Step, ...]:
    """The conversion steps from layout ``have`` to ``want``."""
    if want == have:
        return ()
    if narrows(have, want):
        return (narrow(have),)
    steps: list[Step] = []
    if isinstance(have, Shard):
        steps.append(gather(have))
    if want is COPY:
        steps.append(COPY)
    elif isinstance(want, Shard):
        steps.append(scatter(want))
    return tuple(steps)
