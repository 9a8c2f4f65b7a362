"""The planner decides the layout: the search's candidates, its memory verdicts, fixed settings, the plan's record
of the ranked layouts (and the plan file's check of it), the CLI's table, and the chosen layout training like one
process on 4 gloo ranks."""

from __future__ import annotations

import json

import pytest

import autotp
from autotp.capture import capture, example_inputs_of
from autotp.options import Options
from autotp.planning.layout_cost import Layout, Profile, predict
from autotp.planning.layout_search import fixed_settings, search_layouts
from autotp.planning.machines import MACHINES, machine_named
from autotp.planning.plan import Plan
from autotp.passes.steps import CollectiveOp
from autotp.tools import cli
from tests import capture_cache, layout_workers, models
from tests.distributed import run_on_ranks

CPU = MACHINES["cpu"]


@pytest.fixture(scope="module")
def gpt():
    model = models.build("gpt", layers=4)
    return capture(model, example_inputs_of(model, (models.tokens(8, 16, seed=1),)))


def _labels(search) -> set[str]:
    return {p.layout.label() for p in search.ranked}


def test_every_valid_layout_of_four_devices_is_priced(gpt):
    found = search_layouts(gpt, 4, Options(), {}, CPU)
    shapes = {(p.layout.tp, p.layout.cp, p.layout.pp, p.layout.dp) for p in found.ranked}
    # The GPT's 4 heads take tp 1, 2 and 4; its 4 blocks (plus embedding and head units) take pp up to 4; its 16
    # tokens take cp 2 and 4, with tp, dp or pp (what parallelize runs).
    assert shapes == {(1, 1, 1, 4), (1, 1, 2, 2), (1, 1, 4, 1), (2, 1, 1, 2), (2, 1, 2, 1), (4, 1, 1, 1),
                      (1, 2, 1, 2), (2, 2, 1, 1), (1, 4, 1, 1), (1, 2, 2, 1)}
    assert {p.layout.schedule.value for p in found.ranked if p.layout.pp > 1} == {"gpipe", "1f1b", "interleaved1f1b"}
    assert {p.layout.sequence_parallel for p in found.ranked if p.layout.tp > 1} == {False, True}
    for p in found.ranked:  # microbatches divide each replica's batch; 1F1B has one per stage at least
        lay = p.layout
        assert (8 // lay.dp) % lay.microbatches == 0, lay
        if lay.pp > 1 and lay.schedule.value != "gpipe":
            assert lay.microbatches >= lay.pp * lay.virtual_stages, lay
    times = [p.step_time for p in found.ranked]
    assert times == sorted(times) and found.chosen.fits


def test_layouts_over_the_budget_are_predicted_not_to_fit_and_never_chosen(gpt):
    free = search_layouts(gpt, 4, Options(), {}, CPU)
    budget = sorted({p.memory for p in free.ranked})[len(free.ranked) // 3]  # about two thirds do not fit
    tight = search_layouts(gpt, 4, Options(memory_budget=budget), {}, CPU)
    assert all(p.fits == (p.memory <= budget) for p in tight.ranked)
    assert tight.chosen.fits and tight.chosen.memory <= budget
    assert all(p.fits for p in tight.ranked[:sum(p.fits for p in tight.ranked)])  # fitting ones first
    with pytest.raises(autotp.PlanError, match=r"no layout of 4 devices fits GPT in 0.0009537 MiB per device: the "
                                               r"least memory is .* at"):
        search_layouts(gpt, 4, Options(memory_budget=1000), {}, CPU)


def test_explicit_settings_are_kept(gpt):
    for fixed in ({"tp": 2}, {"pp": 2, "schedule": "gpipe"}, {"dp": 2, "dp_mode": "fsdp"}, {"microbatches": 4, "pp": 2}):
        found = search_layouts(gpt, 4, Options(), fixed, CPU)
        for p in found.ranked:
            for name, value in fixed.items():
                got = getattr(p.layout, name)
                assert getattr(got, "value", got) == value, (fixed, p.layout)
        assert all(getattr(found.options, k) == found.chosen.layout.settings()[k] for k in fixed)
    with pytest.raises(autotp.PlanError, match="no layout of 4 devices suits GPT with .*'tp': 3"):
        search_layouts(gpt, 4, Options(), {"tp": 3}, CPU)
    assert fixed_settings({"tp": None, "pp": 2, "batch": 4}, Options(dp=2)) == {"dp": 2, "pp": 2}


def _profile(**changes) -> Profile:
    """Four equal units of 1 GFLOP, 1M parameters and 1 MB of activations; an all-reduce of 1 MB per step."""
    base = dict(tp=1, sequence_parallel=False, compute=(1e9,) * 4, params=(1e6,) * 4, activations=(1e6,) * 4,
                boundaries=(1e5,) * 3, collectives=(), itemsize=4, vocab_split=False)
    return Profile(**(base | changes))


def test_the_prediction_adds_its_parts():
    h100 = MACHINES["h100"]
    one = predict(_profile(), Layout(1, 1, 1), [0], h100, None)
    assert one.step_time == pytest.approx(3 * 4e9 / h100.node.flops) and one.memory == 4 * 4e6 * 4 + 4e6
    pipe = predict(_profile(), Layout(1, 4, 1, microbatches=8), [0, 1, 2, 3], h100, None)
    assert pipe.bubble == pytest.approx(pipe.compute * 3 / 8)  # (pp-1)/m of the busiest rank's work
    assert pipe.memory == 4 * 1e6 * 4 + 1e6 / 8 * 4  # 1F1B: pp microbatches in flight of 8
    gpipe = predict(_profile(), Layout(1, 4, 1, schedule="gpipe", microbatches=8), [0, 1, 2, 3], h100, None)
    assert gpipe.memory == 4 * 1e6 * 4 + 1e6  # GPipe holds all 8
    tp = predict(_profile(tp=2, collectives=((CollectiveOp.ALL_REDUCE, 1e6, 0),)), Layout(2, 1, 1), [0], h100, None)
    assert tp.tp_comm == pytest.approx(h100.node.all_reduce(1e6, 2))
    # tp=16 spans two nodes of 8: its all-reduces cross InfiniBand.
    wide = predict(_profile(tp=16, collectives=((CollectiveOp.ALL_REDUCE, 1e6, 0),)), Layout(16, 1, 1), [0], h100, None)
    assert wide.tp_comm == pytest.approx(h100.network.all_reduce(1e6, 16) + 14 * h100.network.latency)
    replicated = predict(_profile(), Layout(1, 1, 4, dp_mode="replicate"), [0], h100, None)
    assert replicated.dp_comm == pytest.approx(h100.node.all_reduce(16e6, 4) + 2 * h100.node.latency)


def test_the_plan_records_the_ranked_layouts_and_the_file_check_reads_them():
    model = models.build("gpt", layers=2)
    plan = autotp.plan(model, example_inputs=(models.tokens(8, 16, seed=1),), world_size=4, machine="h100")
    best = plan.layouts[0].layout
    assert (plan.tp, plan.pp, plan.options.dp) == (best.tp, best.pp, best.dp)
    assert any(n.startswith(f"layout {best.label()} chosen by the cost model") for n in plan.notes)
    assert Plan.from_json(plan.to_json()) == plan
    data = json.loads(plan.to_json())
    for field, bad, said in (("memory", -1, "must be at least 0"), ("schedule", "zb", "must be one of"),
                             ("step_time", "fast", "must be a finite non-negative number"),
                             ("tp", 0, "must be at least 1")):
        broken = json.loads(json.dumps(data))
        broken["layouts"][0][field] = bad
        with pytest.raises(autotp.InputError, match=rf"field plan.layouts\[0\].{field} {said}"):
            Plan.from_dict(broken)
    missing = json.loads(json.dumps(data))
    del missing["layouts"][0]["fits"]
    with pytest.raises(autotp.InputError, match=r"plan.layouts\[0\].fits is missing"):
        Plan.from_dict(missing)


def test_machines():
    assert sorted(cli.MACHINE_NAMES) == sorted(MACHINES)
    h100 = machine_named("h100")
    assert h100.link(8, 1) is h100.node and h100.link(2, 8) is h100.network and h100.link(4, 2) is h100.node
    assert h100.ring(4, 1).latency == 3 * h100.node.latency and h100.ring(2, 1) == h100.node
    with pytest.raises(autotp.InputError, match="unknown machine 'tpu'; the machines are: cpu, h100"):
        machine_named("tpu")


def test_cli_prints_the_ranked_layouts(capsys):
    gpt = "examples/gpt.py:build_gpt"
    assert cli.main(["plan", gpt, "--devices", "8", "--machine", "h100", "--tp", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("autotp layouts for GPT on 8 devices (h100), batch 8, seq 32"), lines[0]
    assert lines[1].split()[:5] == ["#", "layout", "ep", "step", "ms"]
    rows = [line.split() for line in lines[3:] if line[:1].isdigit()]
    assert len(rows) == 8 and all(r[1] == "tp2" for r in rows)
    times = [float(r[r.index("yes") - 9]) for r in rows]  # after the label: ep, then the step time
    assert times == sorted(times) and all(r[r.index("yes") - 10] == "1" for r in rows)  # a dense model: ep 1
    assert lines[-1].startswith(f"note: layout {' '.join(rows[0][1:rows[0].index('yes') - 10])} chosen")
    assert cli.main(["plan", gpt, "--devices", "4", "--plan", "x.json"]) == 2
    assert "--plan gives one" in capsys.readouterr().err


def test_the_chosen_layout_trains_like_one_process():
    capture_cache.warm(models.build("gpt", layers=2),  # once here, not once per rank
                       (models.tokens(layout_workers.BATCH, layout_workers.SEQ, seed=1),))
    chosen = run_on_ranks(layout_workers.check_chosen_layouts, 4)[0]
    assert set(chosen) == {"free", "tp=2", "budget"} and chosen["tp=2"].startswith("tp2 "), chosen
    assert chosen["budget"].endswith(" rc") and not chosen["free"].endswith(" rc"), chosen


def test_bench_helpers():
    from bench.layouts import spearman
    from bench.layouts_at_scale import deepen

    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert spearman([1, 1, 2], [5, 5, 6]) == pytest.approx(1.0)
    # 3 layers: embedding, (attention, MLP) x 3, norm, head -> 5 layers repeat the middle layer's two units.
    three = _profile(compute=(0, 1, 2, 3, 4, 5, 6, 7, 8), params=(9,) * 9, activations=(1,) * 9,
                     boundaries=tuple(range(8)), collectives=((CollectiveOp.ALL_REDUCE, 1.0, 1),
                                                              (CollectiveOp.ALL_REDUCE, 2.0, 3),
                                                              (CollectiveOp.ALL_GATHER, 3.0, 7)))
    five = deepen(three, 5)
    assert five.compute == (0, 1, 2, 3, 4, 3, 4, 3, 4, 5, 6, 7, 8)
    assert five.boundaries == (0, 1, 2, 3, 4, 3, 4, 3, 4, 5, 6, 7)
    assert [c[2] for c in five.collectives] == [1, 3, 5, 7, 11]
