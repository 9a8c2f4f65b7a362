"""cp's exchange in the layout search is priced as ``cp_exchange="auto"`` runs it: the all-gather while every
attention's K and V held whole fit auto's limit, else the ring (``planning.context_cost``)."""

from autotp.planning.context_cost import exchange_memory, exchange_time, ring_chosen
from autotp.planning.context_exchange import HOLD_LIMIT
from autotp.planning.machines import Link

LINK = Link("test", flops=1e12, bandwidth=1e9, latency=1e-5)


def test_the_ring_is_priced_where_auto_leaves_the_all_gather():
    assert not ring_chosen((HOLD_LIMIT / 2, HOLD_LIMIT / 2), 4, None)
    assert ring_chosen((HOLD_LIMIT / 2, HOLD_LIMIT), 4, None)
    assert ring_chosen((2e9,), 4, 4e9) and not ring_chosen((0.5e9,), 4, 4e9)  # a quarter of the budget
    assert not ring_chosen((2 * HOLD_LIMIT,), 1, None)  # no exchange without cp


def test_the_ring_holds_one_block_and_moves_half_as_many_bytes_again():
    kv, cp = 8e9, 8
    assert exchange_memory(kv, cp, ring=True) == kv / cp < exchange_memory(kv, cp) == kv * 7 / 8
    ring, gathered = exchange_time(kv, cp, LINK, ring=True), exchange_time(kv, cp, LINK)
    assert abs(ring - 3 * (LINK.latency + 7 / 8 * kv / LINK.bandwidth)) < 1e-9
    assert abs(ring / gathered - 1.5) < 1e-3  # 3 passes of (cp-1)/cp against 2: the bytes dominate here
    assert exchange_time(kv, 1, LINK, ring=True) == exchange_memory(kv, 1, ring=True) == 0.0
