"""What context parallelism costs a layout: the keys and values each attention exchanges, the gradient sum over
the cp ranks, and the activations it divides. Pure functions over a ``layout_cost.Profile`` (no torch), so the
layout search prices cp for 1024 devices as it prices tp.

The exchange is priced as ``cp_exchange="auto"`` runs it (``context_exchange.choose_exchange``): all-gather of K/V
forward and reduce-scatter of their gradients backward while every attention's K and V held whole fit its limit,
else the ring of K/V blocks, which holds about ``1/cp`` of them (``ring_chosen``, ``exchange_time``,
``exchange_memory``). Ulysses, which ``auto`` may take instead of the ring, moves fewer bytes and is not priced:
the ring is the upper bound.
"""

from __future__ import annotations

from autotp.planning.context_exchange import HOLD_LIMIT
from autotp.planning.machines import Link


def ring_chosen(kv: tuple[float, ...], cp: int, budget: int | None) -> bool:
    """Whether ``auto`` leaves the all-gather for the ring: the keys and values of every attention (``kv``: whole
    sequence, one replica's batch, one tp rank's heads) held whole exceed the limit ``choose_exchange`` keeps them
    to (``HOLD_LIMIT``, or a quarter of ``budget``)."""
    limit = budget // 4 if budget else HOLD_LIMIT
    return cp > 1 and sum(kv) > limit


def exchange_time(kv_bytes: float, cp: int, link: Link, ring: bool = False) -> float:
    """Seconds one training step spends exchanging one attention's keys and values over ``cp`` ranks: ``kv_bytes``
    is the whole sequence's K and V (this replica's batch, one tensor-parallel rank's heads). All-gathered forward,
    their gradients reduce-scattered backward; by ``ring``, ``cp - 1`` blocks of ``1/cp`` forward and twice that
    backward (the blocks again, their gradients travelling home), each a message."""
    if cp == 1 or not kv_bytes:
        return 0.0
    if ring:
        # ``link`` is the cp ring's (``Machine.ring``): its latency is a whole ring collective's, cp - 1 hops.
        return 3 * (link.latency + (cp - 1) * kv_bytes / cp / link.bandwidth)
    return 2 * link.all_gather(kv_bytes, cp)


def exchange_memory(kv_bytes: float, cp: int, ring: bool = False) -> float:
    """Bytes one attention's exchange adds to a rank's activations over its own ``1/cp`` of K and V: the
    all-gather holds (and saves for backward) the other ranks' ``(cp-1)/cp``; the ring one block in flight."""
    if cp == 1:
        return 0.0
    return kv_bytes / cp if ring else kv_bytes * (cp - 1) / cp


def grad_sum_time(param_bytes: float, cp: int, link: Link) -> float:
    """Seconds of the all-reduce over the cp ranks that sums each parameter's gradient (every rank computed its
    tokens' part): once per backward."""
    return link.all_reduce(param_bytes, cp) if cp > 1 else 0.0


def sequence_divides(seq: int, cp: int) -> bool:
    """Whether ``cp`` ranks can hold a ``seq``-token sequence: two of ``2 * cp`` equal chunks each (load balance
    under a causal mask)."""
    return cp == 1 or (seq > 0 and seq % (2 * cp) == 0)
