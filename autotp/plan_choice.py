"""The one place a plan is chosen or verified, for ``autotp.plan``, ``autotp.parallelize`` and ``autotp.check``.

Each entry point captures the model its own way (``plan`` stamps identical blocks, ``parallelize`` captures both
modes, ``check`` captures once for many tps), then hands the capture here. A plan the caller gives is checked
against the model and verified as the planner checks its own; otherwise the planner makes one (at the options'
layout, or the layout search's for a number of devices) and the notes every made plan carries are added: inputs
that were synthesised, and how ``pm.generate`` would run on it.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from autotp.capture import Captured, ExampleInputs
from autotp.capture.core.kv_cache import generation_notes
from autotp.errors import InputError
from autotp.options import Options
from autotp.planning import Plan, check_plan_fits, make_plan
from autotp.planning.context_plan import context_notes, plan_context
from autotp.planning.layout_search import fixed_settings, plan_layout
from autotp.planning.machines import Machine
from autotp.planning.planner import verify_plan


@dataclass(frozen=True)
class Search:
    """A layout for the planner to choose: ``world`` devices, the options the search starts from and the layout
    settings the caller fixed (``planning.layout_search``)."""

    world: int
    options: Options
    fixed: dict


def choose_plan(model: nn.Module, captured: Captured, example: ExampleInputs, machine: Machine, *,
                options: Options | None = None, given: Plan | None = None, search: Search | None = None) -> Plan:
    """The plan to apply to ``model`` (captured as ``captured`` on ``example``), priced on ``machine``: ``given``
    checked against the model and ``options``' layout, then verified; else the layout ``search``'s plan; else
    the planner's at ``options``. A made plan notes synthesised inputs and how generation would run."""
    if given is not None:
        if options is None:
            raise InputError("a given plan is checked against the options' layout: pass options")
        fits = check_plan_fits(given, param_shapes(model), options.tp, options.pp, options.stages)
        return verify_plan(captured, fits)
    if search is not None:
        made = plan_layout(captured, search.world, search.options, search.fixed, machine)
    else:
        made = make_plan(captured, options or Options(), machine)
    return with_generation_notes(with_input_note(made, example), model, captured)


def search_options(tp: int | None, options: Options | None, settings: dict, world: int, group=None) -> Search:
    """The search of ``world`` devices from ``options`` and ``settings``, with the layout settings the caller
    fixed (a group given: one pipeline stage, one replica, no cp, as ``group`` carries tensor parallelism only)."""
    fixed = fixed_settings({"tp": tp, **settings}, options)
    if group is not None:
        fixed = {"pp": 1, "dp": 1, "cp": 1} | fixed
    # ep is checked against the layout the search lays out (it must divide that dp x tp), not the defaults'.
    return Search(world, Options.build(options, tp=tp, **{k: v for k, v in settings.items() if k != "ep"}), fixed)


def with_input_note(chosen: Plan, example: ExampleInputs) -> Plan:
    """``chosen``, noting that its example inputs were synthesised (the plan was made from guessed inputs)."""
    return chosen.replace(notes=(*chosen.notes, example.synthesised)) if example.synthesised else chosen


def with_generation_notes(chosen: Plan, model: nn.Module, captured: Captured) -> Plan:
    """``chosen``, noting how ``pm.generate`` would run on it: refused on a pipeline, or re-running the sequence for
    a model with no KV cache (``capture.kv_cache.generation_notes``)."""
    vocab = captured.analysis.vocab
    notes = generation_notes(model, bool(vocab and vocab.heads), chosen.pp)
    if chosen.options.cp > 1:  # checked now, so that what cannot be split along the sequence is refused at plan time
        layout = plan_context(captured, chosen.options.cp, chosen.options.cp_exchange, chosen.options.memory_budget)
        notes = (*context_notes(layout, chosen.options.cp), *notes)
    return chosen.replace(notes=(*chosen.notes, *notes)) if notes else chosen


def required_tp(tp: int | None, options: Options | None, cp: int | None = None) -> int | None:
    """``tp``, which must be given unless ``options`` (or a plan) say it, or ``cp`` is (then 1: cp runs alone)."""
    if tp is None and options is None and cp is not None and cp > 1:
        return 1
    if tp is None and options is None:
        raise InputError("tp must be a positive integer (the number of tensor-parallel ranks), got None")
    return tp


def param_shapes(model: nn.Module) -> dict[str, tuple]:
    """Every parameter's shape, tied ones under each of their names (what a plan may name)."""
    return {name: tuple(p.shape) for name, p in model.named_parameters(remove_duplicate=False)}
