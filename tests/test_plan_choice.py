"""One path through the entry points: ``plan``, ``parallelize`` and ``check`` choose or verify a plan through
``autotp.plan_choice.choose_plan``, and a searched ``parallelize`` captures no more than an explicit one."""

from __future__ import annotations

import pytest
import torch

import autotp
import autotp.api
from autotp.errors import PlanError
from autotp.plan_choice import choose_plan
from tests import models


@pytest.fixture
def captures(monkeypatch) -> list:
    """Every call of the capture entry point ``parallelize`` uses, by training mode."""
    calls = []
    inner = autotp.api.capture

    def counted(model, example, training=None, **kwargs):
        calls.append(training)
        return inner(model, example, training=training, **kwargs)

    monkeypatch.setattr(autotp.api, "capture", counted)
    return calls


def _gpt():
    return models.build("gpt"), (models.tokens(2, 16, seed=1),)


def test_an_explicit_parallelize_captures_once_per_mode(captures):
    model, inputs = _gpt()
    autotp.parallelize(model, tp=1, example_inputs=inputs, quiet=True)
    assert sorted(captures) == [False, True]


def test_a_searched_parallelize_captures_no_more_than_an_explicit_one(captures):
    model, inputs = _gpt()
    pm = autotp.parallelize(model, example_inputs=inputs, world_size=1, quiet=True)
    assert sorted(captures) == [False, True]
    assert pm.plan.layouts, "the searched plan records its ranked layouts"
    pm.eval(), model.eval()
    with torch.no_grad():
        torch.testing.assert_close(models.first_tensor(pm(*inputs)), models.first_tensor(model(*inputs)))


def test_check_plans_with_the_same_notes_as_plan():
    """The checker's plan is ``autotp.plan``'s: the same placements and the same notes, generation's included (a
    model with no KV cache re-runs the sequence per token, which both say)."""
    model, inputs = _gpt()
    planned = autotp.plan(model, 2, inputs)
    checked = autotp.check(model, 2, inputs)
    assert checked.exact
    assert checked.plan.placements == planned.placements
    assert checked.plan.notes == planned.notes
    assert any(note.startswith("generate:") for note in planned.notes)


def test_a_given_plan_is_verified_not_renoted():
    """A plan the caller gives is checked against the model and returned verified, its notes its own."""
    model, inputs = _gpt()
    given = autotp.plan(model, 2, inputs).replace(notes=("mine",))
    report = autotp.check(model, example_inputs=inputs, plan=given)
    assert report.exact and report.plan.notes == ("mine",)


def test_a_given_plan_for_another_layout_is_refused():
    model, inputs = _gpt()
    given = autotp.plan(model, 2, inputs)
    with pytest.raises(PlanError, match="made for tp=2 but tp=4"):
        autotp.check(model, 4, inputs, plan=given)


def test_choose_plan_needs_options_with_a_given_plan():
    model, inputs = _gpt()
    with pytest.raises(autotp.InputError, match="pass options"):
        choose_plan(model, None, None, None, given=autotp.plan(model, 2, inputs))
