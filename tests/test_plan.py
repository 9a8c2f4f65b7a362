"""The plan is a frozen value: JSON round-trips, hashes, and agrees with hand-written HF plans."""

import dataclasses
import fnmatch

import pytest

import autotp
from autotp import Placement, PlacementKind, Plan
from tests import models

EXAMPLE = (models.tokens(2, 16, 0),)


@pytest.fixture(scope="module")
def gpt_plan():
    return autotp.plan(models.build("gpt"), tp=2, vocab="split", example_inputs=EXAMPLE)


def test_json_round_trip(gpt_plan):
    again = Plan.from_json(gpt_plan.to_json())
    assert again == gpt_plan and hash(again) == hash(gpt_plan)
    assert again.fingerprint() == gpt_plan.fingerprint()


def test_placement_order_does_not_change_the_plan(gpt_plan):
    """Two ranks that list the same placements in another order hold the same plan (equal, same hash and
    fingerprint); the JSON text itself differs, so the check is not vacuous."""
    shuffled = gpt_plan.replace(placements=dict(reversed(list(gpt_plan.placements.items()))))
    assert list(shuffled.placements) != list(gpt_plan.placements)
    assert shuffled.to_json() != gpt_plan.to_json()
    assert shuffled == gpt_plan and hash(shuffled) == hash(gpt_plan)
    assert shuffled.fingerprint() == gpt_plan.fingerprint()
    assert Plan.from_json(shuffled.to_json()).fingerprint() == gpt_plan.fingerprint()


def test_fingerprint_sees_a_changed_placement(gpt_plan):
    edited = dict(gpt_plan.placements) | {"transformer.ln_f.weight": Placement(PlacementKind.COLWISE, 0)}
    assert gpt_plan.replace(placements=edited).fingerprint() != gpt_plan.fingerprint()


def test_plan_fields_are_typed_after_a_json_round_trip(gpt_plan):
    again = Plan.from_json(gpt_plan.to_json())
    assert isinstance(again.balance, autotp.options.Balance)
    assert all(isinstance(r.kind, autotp.passes.RegionKind) for r in again.regions)
    assert all(isinstance(c.operator, autotp.passes.Operator) and isinstance(c.op, autotp.passes.CollectiveOp)
               for c in again.collectives)


def test_plan_json_must_be_an_object():
    with pytest.raises(autotp.InputError, match="expected a JSON object, got list"):
        Plan.from_json("[1, 2]")


def test_plan_is_frozen_and_replace_returns_new(gpt_plan):
    with pytest.raises(dataclasses.FrozenInstanceError):
        gpt_plan.tp = 4
    notes = gpt_plan.notes
    edited = gpt_plan.replace(notes=("x",))
    assert edited.notes == ("x",) and gpt_plan.notes == notes != ("x",)


def test_placements_by_original_names(gpt_plan):
    p = gpt_plan.placements
    assert p["transformer.h.0.attn.c_attn.weight"] == Placement(PlacementKind.COLWISE, 0, (64, 64, 64))
    assert p["transformer.h.0.attn.c_proj.weight"].kind == "rowwise"
    assert p["transformer.h.0.attn.c_proj.bias"].kind == "replicated"  # added once, after the all-reduce
    assert p["transformer.h.0.mlp.c_fc.weight"].kind == "colwise"
    assert p["transformer.wte.weight"] == p["lm_head.weight"] == Placement(PlacementKind.VOCAB, 0)
    assert p["transformer.ln_f.weight"].kind == "replicated"
    assert set(p) == {n for n, _ in models.build("gpt").named_parameters(remove_duplicate=False)}


def test_summary_names_regions_and_collectives(gpt_plan):
    text = gpt_plan.summary()
    assert "attention  column: transformer.h.0.attn.c_attn  row: transformer.h.0.attn.c_proj" in text
    assert "all_reduce (forward)" in text


def test_bad_json_is_a_clear_error():
    with pytest.raises(autotp.InputError, match="schema_version"):
        Plan.from_json('{"schema_version": 99}')
    with pytest.raises(autotp.InputError, match="not valid JSON"):
        Plan.from_json("{")


@pytest.mark.parametrize("name", ["hf_llama", "hf_mistral", "hf_qwen2"])
def test_agrees_with_hf_base_model_tp_plan(name):
    model = models.build(name)
    plan = autotp.plan(model, tp=2, vocab="split", example_inputs=EXAMPLE)
    hf_plan = model.config.base_model_tp_plan
    checked = 0
    for param, placement in plan.placements.items():
        if not param.endswith(".weight"):
            continue
        module = param.removeprefix(f"{model.base_model_prefix}.").removesuffix(".weight")
        for pattern, style in hf_plan.items():
            if fnmatch.fnmatch(module, pattern):
                assert placement.kind.value == style, f"{param}: autotp {placement.kind.value}, HF {style}"
                checked += 1
    assert checked == 7 * 2  # seven listed Linears in each of the two layers
