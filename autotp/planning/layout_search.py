"""The planner decides the layout: every valid (tp, cp, pp, dp, dp mode, schedule, microbatches, sequence parallelism)
of ``world`` devices, priced by ``layout_cost`` from the analysis' costs, ranked, the fastest that fits the memory
budget chosen. Settings the caller gave are fixed; the rest are searched.

One plan per tp (and sequence parallelism) gives that tp's ``Profile``: its units between cut candidates, with
their compute, parameters and activations per rank, and the collectives its placements imply (the vocabulary split
is the plan's own cost-model choice at that tp). Every pipeline split is then the planner's own balanced split of
those units, so the predicted stages are the ones ``make_plan`` will build.
"""

from __future__ import annotations

import functools
import math

from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from autotp.capture import Captured
from autotp.errors import InputError, PlanError
from autotp.options import Balance, DataParallelMode, Options, Recompute, Schedule
from autotp.passes.costs import tensor_bytes
from autotp.passes.cuts import find_cuts
from autotp.passes.placement import PlacementKind
from autotp.planning.balance import balanced_split
from autotp.planning.context_cost import sequence_divides
from autotp.planning.context_plan import exchanged_kv
from autotp.planning.ep_runtime import ep_unrunnable
from autotp.planning.expert_cost import ep_sizes
from autotp.planning.expert_profile import moe_layers
from autotp.planning.layout_cost import Layout, Prediction, Profile, predict, ranked
from autotp.planning.machines import Machine
from autotp.planning.plan import Plan
from autotp.planning.planner import cost_sizes, make_plan
from autotp.planning.recompute_cost import cut_outputs, saved_per_unit
from autotp.planning.stage_split import build_units, forced_units

SEARCHED = ("tp", "pp", "dp", "dp_mode", "schedule", "microbatches", "virtual_stages", "sequence_parallel",
            "recompute", "cp", "ep")
"""The ``Options`` fields the search chooses unless the caller fixes them."""

KEPT = 8
"""Layouts a plan records: the chosen one and its runner-ups."""


@dataclass(frozen=True)
class Search:
    """Every layout priced, best first, and the options of the chosen one."""

    ranked: tuple[Prediction, ...]
    options: Options
    world: int

    @property
    def chosen(self) -> Prediction:
        """The layout chosen: the fastest that fits."""
        return self.ranked[0]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def profile_of(captured: Captured, options: Options, machine: Machine) -> Profile:
    """The costs of ``captured`` planned at ``options.tp`` (one stage, the experts split by tp: ep is priced from
    the profile's mixture-of-experts layers), per unit between cut candidates."""
    plan = make_plan(captured, options.replace(pp=1, dp=1, ep=1, microbatches=None, virtual_stages=None), machine)
    analysis = captured.analysis
    sizes = cost_sizes(captured, options.batch, options.seq)
    prop = analysis.propagate_placements(plan.placements, plan.tp, plan.sequence_parallel)
    units = build_units(analysis, prop, plan.tp, sizes)
    boundaries = tuple(tensor_bytes(analysis.nodes[c.value], sizes) for c in units.cuts)
    unit_of_layer: dict[str, int] = {}
    for name, unit in units.unit_of.items():  # a collective is listed at a layer: the unit of its first node
        unit_of_layer.setdefault(analysis.layer(name), unit)
    # every size symbol by the name the plan's shapes use: a second input's sizes (an encoder-decoder's decoder
    # length) at the example's values, as the stage costs take them
    named = {captured.dim_names.get(symbol, symbol): size for symbol, size in sizes.items()}
    collectives = tuple((c.op, float(c.nbytes(plan.batch or 1, plan.seq or 1, named)), unit_of_layer.get(c.module, 0))
                        for c in plan.collectives if c.in_step)
    itemsize = next((p.element_size() for p in captured.module.parameters()), 4)
    vocab = any(p.kind is PlacementKind.VOCAB for p in plan.placements.values())
    ops = [0.0] * len(units.compute)
    for node in analysis.graph.nodes:  # the rewrite adds a few (collectives, slices); the capture's are counted
        if node.op == "call_function":
            ops[units.unit_of[node.name]] += 1
    # compile=True refuses recompute (Options): not offered then.
    recomputed = () if options.compile else tuple(saved_per_unit(units, cut_outputs(analysis, prop, plan.tp, units,
                                                                                     sizes)))
    kv, seq = exchanged_kv(captured, sizes, units.unit_of, len(units.compute), plan.tp)
    shapes = {captured.param_name(t): tuple(p.shape) for t, p in captured.module.named_parameters()}
    moe = moe_layers(analysis, shapes, unit_of_layer, _rank_elements(plan, shapes),
                     float((plan.batch or 1) * (plan.seq or 1)))
    return Profile(plan.tp, plan.sequence_parallel, tuple(units.compute), tuple(units.rank_params),
                   tuple(units.activations), boundaries, collectives, itemsize, vocab, tuple(ops), recomputed, kv, seq,
                   moe)


def _rank_elements(plan: Plan, shapes: dict[str, tuple[int, ...]]) -> dict[str, float]:
    """Elements of each parameter one tensor-parallel rank holds under ``plan``."""
    def split(name: str) -> bool:
        placement = plan.placements.get(name)
        return placement is not None and placement.kind is not PlacementKind.REPLICATED
    return {n: math.prod(s) / (plan.tp if split(n) else 1) for n, s in shapes.items()}


def _profiles(captured: Captured, world: int, options: Options, fixed: Mapping, machine: Machine) -> list[Profile]:
    """A profile for every tp dividing ``world`` at which the model splits (and with sequence parallelism where it
    applies), as ``fixed`` allows."""
    out = []
    for tp in [fixed["tp"]] if "tp" in fixed else _divisors(world):
        flags = [fixed["sequence_parallel"]] if "sequence_parallel" in fixed else [False, True]
        for sp in dict.fromkeys(f and tp > 1 for f in flags):
            try:
                out.append(profile_of(captured, options.replace(tp=tp, sequence_parallel=sp), machine))
            except PlanError:
                continue  # tp does not divide the model's heads or widths, or it has no sequence to split
    return out


SEARCHED_SCHEDULES = (Schedule.GPIPE, Schedule.ONE_F_ONE_B, Schedule.INTERLEAVED_1F1B)
"""The schedules the search tries unasked. The split-backward ones (zero bubble, DualPipeV) run when fixed, priced
as interleaved; the cost model has no term yet for the weight gradients they defer (measured slower than 1F1B
on CPU ranks with one thread, where there is no idle time to fill)."""


def _pipelines(pp: int, batch: int, units: int, fixed: Mapping) -> Iterator[tuple[Schedule, int, int]]:
    """(schedule, microbatches, stages per rank) for ``pp`` pipeline ranks and a replica's ``batch``: microbatches
    dividing the batch, at least one per stage for the 1F1B schedules (a multiple of pp when interleaved)."""
    if pp == 1:
        yield Schedule(fixed.get("schedule", Schedule.ONE_F_ONE_B)), 1, 1
        return
    for schedule in [Schedule(fixed["schedule"])] if "schedule" in fixed else SEARCHED_SCHEDULES:
        v = 2 if schedule.v_shaped else fixed.get("virtual_stages") or (2 if schedule.virtual else 1)
        if pp * v > units:
            continue
        least = 1 if schedule is Schedule.GPIPE else pp * v
        choices = [fixed["microbatches"]] if fixed.get("microbatches") else _divisors(batch)
        for m in choices:
            if m >= least and batch % m == 0 and (not schedule.virtual or m % pp == 0):
                yield schedule, m, v


def _recomputes(profile: Profile, fixed: Mapping) -> list[Recompute]:
    """Recompute off, and on where the profile offers it and it saves memory: ranked by time it is slower (its
    forwards run twice), so it is chosen only when the memory budget needs it."""
    if "recompute" in fixed:
        return [Recompute(fixed["recompute"])]
    return [Recompute.NONE, Recompute.BLOCKS] if any(profile.recomputed) else [Recompute.NONE]


def _contexts(profile: Profile, rest: int, fixed: Mapping) -> list[int]:
    """The cp sizes to try with ``rest`` devices per tp group: those dividing it and the sequence's ``2 * cp``
    chunks, where the profile offers cp (``fixed`` may name one)."""
    if "cp" in fixed:
        return [fixed["cp"]] if rest % fixed["cp"] == 0 else []
    offered = bool(profile.kv)
    return [cp for cp in _divisors(rest) if cp == 1 or (offered and sequence_divides(profile.seq, cp))]


def runs(layout: Layout) -> bool:
    """Whether parallelize runs ``layout``: its settings make valid ``Options`` (which refuse what cp is not yet
    verified with) whose ep the runtime runs (``ep_runtime``), so the search never chooses a layout it would then
    refuse."""
    try:
        options = Options(**layout.settings())
    except InputError:
        return False
    return ep_unrunnable(options) is None


def layouts(profile: Profile, world: int, batch: int, fixed: Mapping, every: bool = False) -> Iterator[Layout]:
    """Every layout of ``world`` devices at the profile's tp that ``fixed`` allows, for a global ``batch``
    (``every``: cp and ep layouts parallelize does not run yet too, to price published ones)."""
    for cp in _contexts(profile, world // profile.tp, fixed):
        rest = world // (profile.tp * cp)
        for pp in [fixed["pp"]] if "pp" in fixed else _divisors(rest):
            dp = rest // pp
            if rest % pp or fixed.get("dp", dp) != dp or batch % dp or pp > len(profile.compute):
                continue
            modes = [DataParallelMode(fixed["dp_mode"])] if "dp_mode" in fixed else list(DataParallelMode)
            for mode in modes if dp > 1 else modes[:1]:
                for schedule, m, v in _pipelines(pp, batch // dp, len(profile.compute), fixed):
                    for recompute in _recomputes(profile, fixed):
                        # Experts divided among ep ranks only without cp (not run together yet).
                        for ep in (ep_sizes(profile.moe, profile.tp, dp, fixed.get("ep")) if cp == 1
                                   else [1] if fixed.get("ep", 1) == 1 else []):
                            layout = Layout(profile.tp, pp, dp, mode, schedule, m, v, profile.sequence_parallel,
                                            recompute, cp, ep)
                            if (cp == 1 and ep == 1) or every or runs(layout):
                                yield layout


def search_layouts(captured: Captured, world: int, options: Options, fixed: Mapping, machine: Machine,
                   budget: int | None = None, profiles: list[Profile] | None = None) -> Search:
    """Price every layout of ``world`` devices (``fixed``: the settings the caller gave) and rank them; the chosen
    one is the fastest whose memory fits ``budget`` (default: ``options.memory_budget``, else the machine's).
    ``profiles`` (default: planned here, one per tp dividing ``world``) may be given to price many worlds."""
    analysis = captured.analysis
    if profiles is None:
        profiles = _profiles(captured, world, options, fixed, machine)
    batch = options.batch or cost_sizes(captured, None, None).get(_batch_symbol(captured), 1)
    # The cut candidates are the graph's, the same at every tp.
    forced = forced_units(analysis, find_cuts(analysis.graph, analysis.trainable, analysis.grad), options.cuts) if options.cuts else []
    found = rank_layouts(profiles, world, batch, fixed, machine, budget if budget is not None else
                         options.memory_budget, options.balance, forced)
    if not found:
        raise PlanError(f"no layout of {world} devices suits {captured.model_name} with {dict(fixed) or 'nothing'} "
                        f"fixed: tp must divide its heads and widths, pp at most its blocks, dp the batch of {batch}, ep "
                        "dp x tp and every mixture-of-experts layer's experts; "
                        "fix fewer settings or use another number of devices")
    if not found[0].fits:
        least = min(found, key=lambda p: p.memory)
        limit = budget if budget is not None else options.memory_budget or machine.device_memory
        raise PlanError(f"no layout of {world} devices fits {captured.model_name} in {_mib(limit)} per device: the "
                        f"least memory is {least.layout.label()} at {_mib(least.memory)}; use more devices, a larger "
                        "memory_budget or a smaller batch")
    return Search(tuple(found), options.replace(**found[0].layout.settings()), world)


def rank_layouts(profiles: list[Profile], world: int, batch: int, fixed: Mapping, machine: Machine,
                 budget: int | None, balance: Balance = Balance.BOTH, forced=(), every: bool = False) -> list[Prediction]:
    """Every layout of ``world`` devices the profiles and ``fixed`` allow, priced and ranked (a pure function: the
    stages are the planner's balanced split of each profile's units; ``every``: as for ``layouts``)."""
    starts, predictions = {}, []
    for profile in profiles:
        if world % profile.tp:
            continue
        for layout in layouts(profile, world, batch, fixed, every):
            key = (id(profile), layout.pp * layout.virtual_stages)
            if key not in starts:
                starts[key] = _split(profile.compute, profile.params, key[1], balance, tuple(forced))
            predictions.append(predict(profile, layout, starts[key], machine, budget))
    return ranked(predictions)


@functools.lru_cache(maxsize=1024)
def _split(compute: tuple, params: tuple, stages: int, balance: Balance, forced: tuple) -> tuple[int, ...]:
    """``balance.balanced_split``, kept: a sweep over device counts (and the profiles with and without sequence
    parallelism, whose units cost alike) asks for the same splits again, each a dynamic program over the units."""
    return tuple(balanced_split(compute, params, stages, balance, list(forced)))


def _batch_symbol(captured: Captured) -> str:
    """The capture's symbol for the batch (``B``), as the size values are keyed."""
    return next((s for s, readable in captured.dim_names.items() if readable == "B"), "B")


def _mib(nbytes) -> str:
    return "no limit" if nbytes is None else f"{nbytes / 2**20:.4g} MiB"


def fixed_settings(settings: Mapping, options: Options | None) -> dict:
    """The searched settings the caller fixed: given as keywords (not None), or set in ``options`` away from
    their defaults."""
    fixed = {k: v for k, v in settings.items() if k in SEARCHED and v is not None}
    if options is not None:
        defaults = Options()
        fixed = {k: getattr(options, k) for k in SEARCHED if getattr(options, k) != getattr(defaults, k)} | fixed
    for name, value in fixed.items():
        if name in ("tp", "pp", "dp", "cp", "microbatches", "virtual_stages", "ep") and (
                isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise InputError(f"{name} must be a positive integer, got {value!r}")
    return fixed


def plan_layout(captured: Captured, world: int, options: Options, fixed: Mapping, machine: Machine) -> Plan:
    """The plan of the layout the search chooses, with the ranked layouts (the chosen one first) and why."""
    found = search_layouts(captured, world, options, fixed, machine)
    best = found.chosen
    plan = make_plan(captured, found.options, machine)
    runner = next((p for p in found.ranked[1:] if p.fits), None)
    why = (f"layout {best.layout.label()} chosen by the cost model ({machine.description}) among "
           f"{len(found.ranked)} layouts of {world} devices: predicted step {best.step_time * 1e3:.4g} ms, "
           f"{_mib(best.memory)} per device")
    if runner is not None:
        why += f"; runner-up {runner.layout.label()} at {runner.step_time * 1e3:.4g} ms, {_mib(runner.memory)}"
    if fixed:
        given = ", ".join(f"{k}={getattr(v, 'value', v)}" for k, v in fixed.items())
        why += f"; fixed by the caller: {given}"
    return plan.replace(layouts=found.ranked[:KEPT], notes=(*plan.notes, why))
