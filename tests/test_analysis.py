"""Analyse once: one ``Analysis`` per captured mode, one propagation per plan, passes run by a runner that names
the one that failed; options recorded in the plan; a plan's report-only fields never silently ignored."""

from __future__ import annotations

import pytest
import torch

import autotp
from autotp.capture import capture
from autotp.options import Options
from autotp.passes import analysis as analysis_module
from autotp.passes.analysis import Analysis, PassFailed, run_pass
from autotp.planning import Plan, make_plan
from autotp.planning.planner import verify_plan
from autotp.rewrite import build_graph
from examples.gpt import build_gpt
from tests import capture_cache, models

IDS = models.tokens(2, 16, 0)


@pytest.fixture
def counted(monkeypatch):
    """Counts of analyses built (by the mode of the capture they analyse) and of propagations run."""
    counts = {"analyses": [], "propagations": 0}
    build, propagate = Analysis.__init__, Analysis.propagate

    def counting_init(self, captured):
        counts["analyses"].append(captured.training)
        build(self, captured)

    def counting_propagate(self, *args, **kwargs):
        counts["propagations"] += 1
        return propagate(self, *args, **kwargs)

    monkeypatch.setattr(Analysis, "__init__", counting_init)
    monkeypatch.setattr(Analysis, "propagate", counting_propagate)
    with capture_cache.bypassed():  # an earlier test's capture of the same model would come with its analysis
        yield counts


def test_one_check_builds_the_analysis_once_per_captured_mode(counted):
    torch.manual_seed(0)
    report = autotp.check(build_gpt(n_layer=2), tp=2, example_inputs=(IDS,), vocab="split")
    assert report.exact, str(report)
    assert counted["analyses"] == [True]  # the checker captures the train mode only: one analysis


def test_every_rank_reuses_the_planners_propagation(counted):
    torch.manual_seed(0)
    captured = capture(build_gpt(n_layer=2), (IDS,))
    plan = make_plan(captured, Options(tp=4, vocab="split"))
    after_planning = counted["propagations"]
    for rank in range(4):
        build_graph(captured, plan, rank, None)
    assert counted["propagations"] == after_planning
    assert verify_plan(captured, plan) == plan  # an unedited plan: nothing recomputed, nothing propagated again
    assert counted["propagations"] == after_planning
    assert counted["analyses"] == [True]


def test_a_failing_pass_is_named_with_the_passes_before_it():
    done: list[str] = []
    run_pass("projections", lambda: 1, done)
    with pytest.raises(PassFailed, match=r"pass 'vocabulary' failed \(passes run before it: projections\)"):
        run_pass("vocabulary", lambda: {}["missing"], done)
    assert done == ["projections"]


def test_a_pass_raising_inside_the_analysis_is_named(monkeypatch):
    def broken(*args):
        raise ValueError("no such op")

    monkeypatch.setattr(analysis_module, "find_vocab", broken)
    captured = capture(build_gpt(n_layer=1), (IDS,))
    with pytest.raises(PassFailed, match="pass 'vocabulary' failed .*projections, embeddings, trainable.*no such op"):
        captured.analysis


def test_a_plan_records_its_options_and_they_survive_json():
    plan = autotp.plan(build_gpt(n_layer=1), tp=2, example_inputs=(IDS,), vocab="whole", memory_budget="1GiB")
    assert plan.options == Options(tp=2, vocab="whole", memory_budget=2**30)
    again = Plan.from_json(plan.to_json())
    assert again.options == plan.options and again == plan


def test_options_refuse_a_bad_value_naming_the_setting():
    with pytest.raises(autotp.InputError, match=r"schedule must be one of \['gpipe', '1f1b', 'interleaved1f1b', 'interleavedzb', 'zbv', 'dualpipev'\]"):
        Options(schedule="zigzag")
    with pytest.raises(autotp.InputError, match="unknown setting.*vocabulary.*the settings are: tp, pp"):
        autotp.plan(build_gpt(n_layer=1), tp=2, example_inputs=(IDS,), vocabulary="split")
    with pytest.raises(autotp.InputError, match="compile=True runs tensor-parallel graphs"):
        Options(tp=2, pp=2, compile=True)
    assert repr(Options(tp=2, vocab="split")) == "Options(tp=2, vocab='split')"


def test_edited_collectives_are_recomputed_and_said():
    captured = capture(build_gpt(n_layer=1), (IDS,))
    plan = make_plan(captured, Options(tp=2, vocab="split"))
    edited = plan.replace(collectives=plan.collectives[:1])
    applied = verify_plan(captured, edited)
    assert applied.collectives == plan.collectives
    assert "collectives recomputed from the placements: the plan listed 1" in applied.notes[-1]


def test_a_region_its_placements_contradict_is_dropped_and_said():
    captured = capture(build_gpt(n_layer=1), (IDS,))
    plan = make_plan(captured, Options(tp=2, vocab="split"))
    attention = next(r for r in plan.regions if r.kind.value == "attention")
    swapped = attention.__class__(attention.kind, attention.rows, attention.columns)
    edited = plan.replace(regions=tuple(swapped if r is attention else r for r in plan.regions))
    applied = verify_plan(captured, edited)
    assert swapped not in applied.regions and len(applied.regions) == len(plan.regions) - 1
    assert f"the attention region listing {attention.rows[0]} among its columns (its weight is rowwise(dim=1))" \
        in applied.notes[-1]
    assert applied.placements == plan.placements and applied.collectives == plan.collectives
