"""The layout search's per-profile index (``planning.unit_index``): a stage's collectives priced from their count
and summed bytes equal the per-collective prices, the MoE layers of a stage are its own, and the pipeline splits
kept across searches are the planner's."""

from __future__ import annotations

import random

import pytest

from autotp.options import Balance
from autotp.passes.steps import CollectiveOp
from autotp.planning import layout_cost, layout_search
from autotp.planning.balance import balanced_split
from autotp.planning.expert_cost import MoeLayer
from autotp.planning.layout_cost import Profile
from autotp.planning.machines import MACHINES
from autotp.planning.unit_index import index_of

UNITS = 12


def _profile() -> Profile:
    """12 units of uneven costs, 40 collectives of both kinds on random units (in no unit order), an MoE layer on
    every third unit."""
    rng = random.Random(0)
    ops = (CollectiveOp.ALL_REDUCE, CollectiveOp.ALL_GATHER)
    collectives = tuple((rng.choice(ops), rng.uniform(1e5, 1e8), rng.randrange(UNITS)) for _ in range(40))
    moe = tuple(MoeLayer(u, 8, 2, 64, 128, 1e6, 5e5, 4096.0) for u in range(0, UNITS, 3))
    return Profile(tp=4, sequence_parallel=False, compute=tuple(rng.uniform(1e9, 5e9) for _ in range(UNITS)),
                   params=tuple(rng.uniform(1e6, 4e6) for _ in range(UNITS)), activations=(1e6,) * UNITS,
                   boundaries=(1e5,) * (UNITS - 1), collectives=collectives, itemsize=2, vocab_split=False,
                   moe=moe)


def _scanned(profile: Profile, link, share: float, calls: int, units: range) -> float:
    """The tensor-parallel time of ``units`` priced collective by collective."""
    total = 0.0
    for op, nbytes, unit in profile.collectives:
        if unit in units:
            price = link.all_reduce if op is CollectiveOp.ALL_REDUCE else link.all_gather
            total += calls * link.latency + price(nbytes * share, profile.tp) - link.latency
    return total


@pytest.mark.parametrize("units", [range(0, UNITS), range(0, 1), range(3, 7), range(11, 12), range(5, 5)])
def test_a_stage_priced_from_the_index_equals_its_collectives_priced_one_by_one(units):
    profile, link = _profile(), MACHINES["h100"].ring(4, 1)
    want = _scanned(profile, link, 0.25, 3, units)
    assert layout_cost._tp_time(profile, link, 0.25, 3, units) == pytest.approx(want, rel=1e-12, abs=1e-15)
    assert [m.unit for m in index_of(profile).moe_in(units)] == [u for u in units if u % 3 == 0]


def test_the_index_is_built_once_per_profile_and_equal_for_an_equal_profile():
    profile = _profile()
    assert index_of(profile) is index_of(profile)
    assert index_of(_profile()) == index_of(profile)


def test_a_kept_pipeline_split_is_the_planners():
    profile = _profile()
    for stages in (1, 3, 5):
        got = layout_search._split(profile.compute, profile.params, stages, Balance.BOTH, ())
        assert list(got) == balanced_split(profile.compute, profile.params, stages, Balance.BOTH)
