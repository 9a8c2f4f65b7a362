"""What context parallelism costs a layout: the keys and values each attention exchanges, the gradient sum over
the cp ranks, and the activations it divides. Pure functions over a ``layout_cost.Profile`` (no torch), so the
layout search prices cp for 1024 devices as it prices tp.

The exchange is priced by one helper, ``exchange_time`` (and ``exchange_memory``): all-gather of K/V forward,
reduce-scatter of their gradients backward. Another exchange (a ring of K/V blocks, Ulysses' all-to-all) is priced
by replacing that helper.
"""

from __future__ import annotations

from autotp.planning.machines import Link


def exchange_time(kv_bytes: float, cp: int, link: Link) -> float:
    """Seconds one training step spends exchanging one attention's keys and values over ``cp`` ranks: ``kv_bytes``
    is the whole sequence's K and V (this replica's batch, one tensor-parallel rank's heads); all-gathered forward,
    their gradients reduce-scattered backward (the same bytes: a ring moves ``(cp-1)/cp`` of them each way)."""
    if cp == 1 or not kv_bytes:
        return 0.0
    return 2 * link.all_gather(kv_bytes, cp)


def exchange_memory(kv_bytes: float, cp: int) -> float:
    """Bytes one attention's exchange adds to a rank's activations over its own ``1/cp`` of K and V: the
    all-gather holds (and saves for backward) the other ranks' ``(cp-1)/cp``."""
    return kv_bytes * (cp - 1) / cp if cp > 1 else 0.0


def grad_sum_time(param_bytes: float, cp: int, link: Link) -> float:
    """Seconds of the all-reduce over the cp ranks that sums each parameter's gradient (every rank computed its
    tokens' part): once per backward."""
    return link.all_reduce(param_bytes, cp) if cp > 1 else 0.0


def sequence_divides(seq: int, cp: int) -> bool:
    """Whether ``cp`` ranks can hold a ``seq``-token sequence: two of ``2 * cp`` equal chunks each (load balance
    under a causal mask)."""
    return cp == 1 or (seq > 0 and seq % (2 * cp) == 0)
