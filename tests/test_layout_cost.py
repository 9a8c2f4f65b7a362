"""The layout cost model's pure pricing: ranks time-sharing a host's cores, recompute as a searched option, and the
plan file's record of it. Pure functions over hand-made profiles (no timings, no capture)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from autotp.options import Recompute
from autotp.planning.layout_cost import Layout, Prediction, Profile, predict, shared_cores
from autotp.planning.layout_search import layouts, rank_layouts
from autotp.planning.machines import MACHINES, Link
from autotp.planning.recompute_cost import saved_per_unit, units_cost
from autotp.planning.stage_split import Units

ONE_CORE = Link("test core", flops=1e9, bandwidth=1e9, latency=1e-3, op_overhead=1e-4)
"""1 GFLOP/s, 1 ms a collective, 100 us an op: round numbers to price by hand."""
TWO_CORES = dataclasses.replace(MACHINES["cpu"], node=ONE_CORE, network=ONE_CORE, cores=2)


def _profile(**changes) -> Profile:
    """Four units of 1 MFLOP and 100 ops each (op cost dominates: 1 ms of compute, 10 ms of ops per forward),
    1000 parameters, 1 MB of activations of which recompute would drop 0.9 MB (the last unit: none)."""
    base = dict(tp=1, sequence_parallel=False, compute=(1e6,) * 4, params=(1e3,) * 4, activations=(1e6,) * 4,
                boundaries=(1e5,) * 3, collectives=(), itemsize=4, vocab_split=False, ops=(100.0,) * 4,
                recomputed=(9e5, 9e5, 9e5, 0.0))
    return Profile(**(base | changes))


def test_shared_cores_serialise_compute_and_fill_bubbles():
    # A device per rank, or no more ranks than cores: the compute and bubble are the fullest rank's own.
    assert shared_cores([2.0, 1.0], 0, 1, 0.5, 8, None) == (2.0, 0.5)
    assert shared_cores([2.0, 1.0], 0, 1, 0.5, 2, 2) == (2.0, 0.5)
    # 4 ranks on 2 cores, 2 per pipeline position: all (2 + 1) * 2 seconds over 2 cores; the critical path
    # (2 + 1 for one microbatch) is no longer, so no bubble is left.
    assert shared_cores([2.0, 1.0], 0, 1, 0.5, 4, 2) == (3.0, 0.0)
    # A pipeline of one microbatch runs its stages one after another: 4 s, of which the cores do 2 s' worth each.
    assert shared_cores([1.0] * 4, 0, 1, 3.0, 4, 2) == (2.0, 2.0)
    # With 4 microbatches the fill and drain wait on a quarter of each other stage: 1 + 3 / 4 < 4 / 2.
    assert shared_cores([1.0] * 4, 0, 4, 0.75, 4, 2) == (2.0, 0.0)
    # Unequal stages: the path is the fullest's compute plus the others' per-microbatch share, not pp times it.
    assert shared_cores([3.0, 1.0, 1.0, 1.0], 0, 2, 4.5, 4, 4 / 3) == (4.5, 0.0)
    assert shared_cores([3.0, 1.0, 1.0, 1.0], 0, 2, 4.5, 4, 2) == (3.0, 1.5)


def test_oversubscribed_ranks_pay_every_ranks_ops():
    """Data parallelism runs every op on every rank; a pipeline runs each op once. On devices of their own dp4
    wins (a quarter of the batch each); on 2 shared cores the pipeline does (a quarter of the ops each)."""
    dp4, pp4 = Layout(1, 1, 4, dp_mode="replicate"), Layout(1, 4, 1, schedule="gpipe", microbatches=1)
    dedicated = dataclasses.replace(TWO_CORES, cores=None)
    shared = {lay.pp: predict(_profile(), lay, [0, 1, 2, 3][:lay.pp], TWO_CORES, None) for lay in (dp4, pp4)}
    alone = {lay.pp: predict(_profile(), lay, [0, 1, 2, 3][:lay.pp], dedicated, None) for lay in (dp4, pp4)}
    forward = 4 * 1e6 / 1e9 + 4 * 100 * 1e-4  # the whole model's forward: 4 ms of FLOPs, 40 ms of ops
    # dp4 on 2 cores: each rank a quarter of the FLOPs and every op, forward and backward (3x), 4 ranks over 2.
    assert shared[1].compute == pytest.approx(4 * 3 * (4e6 / 4 / 1e9 + 0.04) / 2)
    # pp4 with one microbatch runs its stages one after another: the whole forward and backward, no overlap.
    assert shared[4].compute + shared[4].bubble == pytest.approx(3 * forward)
    assert shared[4].step_time < shared[1].step_time and alone[1].step_time < alone[4].step_time


def test_gpu_clusters_have_a_device_per_rank():
    assert all(MACHINES[name].cores is None for name in ("h100", "h200", "a100"))
    assert MACHINES["cpu"].cores >= 1
    h100 = MACHINES["h100"]
    pipe = predict(_profile(), Layout(1, 4, 1, microbatches=8), [0, 1, 2, 3], h100, None)
    assert pipe.bubble == pytest.approx((pipe.compute + pipe.tp_comm) * 3 / 8)


def test_recompute_runs_the_forward_again_and_keeps_less():
    plain = predict(_profile(), Layout(1, 2, 1, microbatches=2), [0, 2], TWO_CORES, None)
    again = predict(_profile(), Layout(1, 2, 1, microbatches=2, recompute="blocks"), [0, 2], TWO_CORES, None)
    # Units 0-2 run their forward once more (1 MFLOP and 100 ops each, per microbatch); unit 3, the head, not.
    # Two pipeline ranks on two cores, each its own: stage 0 (units 0, 1) is the fullest, both recomputed.
    assert again.compute - plain.compute == pytest.approx(2 * 1e6 / 1e9 + 2 * 2 * 100 * 1e-4)
    # The fullest stage is now the last (units 2, 3): it keeps 0.1 of unit 2's 1 MB and all the head's, plus one
    # unit's activations while backward recomputes it; 1F1B holds both microbatches (pp = 2), each half the batch.
    state = 2 * 1e3 * 4 * 4
    assert plain.memory == state + 2e6
    assert again.memory == state + ((1e5 + 1e6) * 2 + 1e6) / 2


def test_recompute_is_searched_and_chosen_only_when_the_budget_needs_it():
    profile = _profile()
    found = list(layouts(profile, 4, 8, {}))
    assert {lay.recompute for lay in found} == {Recompute.NONE, Recompute.BLOCKS}
    assert len(found) == 2 * sum(lay.recompute is Recompute.NONE for lay in found)
    assert {lay.recompute for lay in layouts(profile, 4, 8, {"recompute": "none"})} == {Recompute.NONE}
    assert {lay.recompute for lay in layouts(_profile(recomputed=()), 4, 8, {})} == {Recompute.NONE}
    free = rank_layouts([profile], 4, 8, {}, TWO_CORES, None)
    assert free[0].layout.recompute is Recompute.NONE  # never faster: its forwards run twice
    least_plain = min(p.memory for p in free if p.layout.recompute is Recompute.NONE)
    tight = rank_layouts([profile], 4, 8, {}, TWO_CORES, least_plain - 1)
    assert tight[0].fits and tight[0].layout.recompute is Recompute.BLOCKS
    assert all(p.fits == (p.memory <= least_plain - 1) for p in tight)


def test_saved_per_unit_matches_the_recompute_trade():
    units = Units(cuts=[], unit_of={}, compute=[1.0, 2.0, 3.0], rank_params=[0, 0, 0], activations=[10.0, 5.0, 7.0],
                  param_sets=[set()] * 3)
    assert saved_per_unit(units, [4.0, 6.0]) == [6.0, 0.0, 0.0]  # unit 1 keeps more than it made; the last kept
    assert units_cost(units, [4.0, 6.0], Recompute.BLOCKS).saved_bytes == 6.0


def test_the_layout_record_reads_recompute_and_plans_written_before_it():
    from autotp.planning.plan_file import _LAYOUT, _LAYOUT_REQUIRED

    pred = predict(_profile(), Layout(1, 1, 1, recompute="blocks"), [0], TWO_CORES, None)
    data = json.loads(json.dumps(pred.to_dict(), default=str))
    assert data["recompute"] == "blocks" and Prediction.from_dict(data) == pred
    assert "recompute" in _LAYOUT and "recompute" not in _LAYOUT_REQUIRED
    older = {k: v for k, v in data.items() if k != "recompute"}
    assert Prediction.from_dict(older).layout.recompute is Recompute.NONE
    assert pred.layout.label() == "tp1 pp1 dp1 rc" and pred.layout.settings()["recompute"] is Recompute.BLOCKS
