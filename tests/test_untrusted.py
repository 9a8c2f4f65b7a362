"""Files someone else wrote: plan files, optimizer state, DCP metadata and Hugging Face indexes never run code,
and each hostile or malformed one is refused with an autotp error saying what is wrong.

Each payload would create a marker file if it ran; the tests assert the marker never appears and the error's
type and message.
"""

from __future__ import annotations

import copy
import json

import pytest

import autotp
from autotp.planning.shape_expr import parse_size
from autotp.tools import cli

GPT = "examples/gpt.py:build_gpt"


def _payload(marker) -> str:
    """Python that creates ``marker`` when evaluated (as ``sympy.sympify`` would evaluate a plan's size)."""
    return f"__import__('pathlib').Path({str(marker)!r}).touch()"


@pytest.fixture(scope="module")
def gpt_plan(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("plan") / "gpt.json"
    assert cli.main(["plan", GPT, "--tp", "2", "--format", "json", "-o", str(out)]) == 0
    return json.loads(out.read_text())


def _edited(plan: dict, edit) -> dict:
    plan = copy.deepcopy(plan)
    edit(plan)
    return plan


def test_plan_sizes_are_the_size_language_the_planner_writes():
    for text, expected in [("B*T", "B*T"), ("64", "64"), ("(T//2)", "floor(T/2)"), ("B*(T - 1)", "B*(T - 1)"),
                           ("Max(1, T)", "Max(1, T)"), ("T**2", "T**2"), ("3 - T", "3 - T")]:
        assert str(parse_size(text)) == expected


def test_a_plan_size_that_is_python_never_runs(gpt_plan, tmp_path, capsys):
    marker = tmp_path / "ran"
    hostile = _edited(gpt_plan, lambda p: p["collectives"][0].update(shape=["B", _payload(marker)]))
    with pytest.raises(autotp.InputError, match=r"field plan\.collectives\[0\]\.shape\[1\] is not a size"):
        autotp.Plan.from_dict(hostile)
    # The CLI reads plan files the same way: one line on stderr, exit 2, nothing run.
    path = tmp_path / "hostile.json"
    path.write_text(json.dumps(hostile))
    assert cli.main(["plan", GPT, "--plan", str(path)]) == 2
    assert "collectives[0].shape[1] is not a size" in capsys.readouterr().err
    assert cli.main(["viz", GPT, "--plan", str(path), "-o", str(tmp_path / "p.dot")]) == 2
    for text in ["T.__class__", "9**9**9", "exec('x')", "f(T)", "lambda: 1", "T[0]", "1e5"]:
        with pytest.raises(ValueError):
            parse_size(text)
    assert not marker.exists()


@pytest.mark.parametrize("edit, message", [
    (lambda p, n: p["placements"][n].update(dim=0.0), r"placements\['{n}'\]\.dim must be a whole number, got 0\.0"),
    (lambda p, n: p["placements"][n].update(dim="0"), r"placements\['{n}'\]\.dim must be a whole number, got '0'"),
    (lambda p, n: p["placements"][n].update(segments=[-64, 256]),
     r"placements\['{n}'\]\.segments\[0\] must be at least 1, got -64"),
    (lambda p, n: p.update(tp="2"), r"field plan\.tp must be a whole number, got '2' \(str\)"),
    (lambda p, n: p["collectives"][0].update(itemsize=4.5), r"collectives\[0\]\.itemsize must be a whole number"),
    (lambda p, n: p.update(sequence_paralel=True), r"plan\.sequence_paralel is not a field here"),
])
def test_plan_fields_of_the_wrong_type_are_named(gpt_plan, edit, message):
    name = next(iter(gpt_plan["placements"]))
    with pytest.raises(autotp.InputError, match=message.format(n=name.replace(".", r"\."))) as caught:
        autotp.Plan.from_dict(_edited(gpt_plan, lambda p: edit(p, name)))
    assert "\n" not in str(caught.value)


def test_a_placement_built_in_code_refuses_bad_numbers():
    with pytest.raises(ValueError, match="segments must hold whole numbers of at least 1"):
        autotp.Plan(tp=2, placements={"w": autotp.planning.plan.Placement("colwise", 0, (-4, 12))})
    with pytest.raises(ValueError, match="dim must hold whole numbers"):
        autotp.planning.plan.Placement("colwise", 0.0)
