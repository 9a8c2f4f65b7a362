"""Plan pipeline stages: cut candidates from the graph, costs per unit, a balanced split.

A *unit* is the run of nodes between two consecutive cut candidates. The split chooses which unit
starts each stage (``balance.balanced_split``), honouring cuts a user forces by module name.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from autotp.errors import PlanError
from autotp.names import within_any
from autotp.options import Balance
from autotp.passes.costs import costs, evaluate, tensor_bytes
from autotp.passes.cuts import Cut, find_cuts, module_starts, param_users, unit_index
from autotp.passes.placement import Shard
from autotp.planning.balance import balanced_split
from autotp.planning.plan import Stage


@dataclass
class Units:
    """The model as a chain of units, with per-unit costs at given sizes."""

    cuts: list[Cut]
    unit_of: dict[str, int]
    """Node name -> unit index."""
    compute: list[float]
    """Forward FLOPs per tensor-parallel rank."""
    rank_params: list[float]
    """Parameter elements per tensor-parallel rank (what a rank's memory holds). A tensor read by several
    units counts in each, which is exact when its readers end in different stages (a tied embedding and
    head) and an overestimate when they share one."""
    activations: list[float]
    """Activation bytes per tensor-parallel rank."""
    param_sets: list[set[str]]
    """The parameters (``get_attr`` nodes) each unit reads."""
    param_sizes: dict[str, int] = field(default_factory=dict)
    """Elements of each parameter."""

    def stage_params(self, start: int, stop: int) -> int:
        """Parameters a stage holding units[start:stop] keeps (each tensor once)."""
        held = set().union(*self.param_sets[start:stop])
        return sum(self.param_sizes[n] for n in held)


def build_units(analysis, prop, tp: int, sizes: dict[str, int]) -> Units:
    """Cut the graph at every candidate and cost each unit; work on split values counts 1/tp."""
    graph = analysis.graph
    cuts = find_cuts(graph, analysis.trainable, analysis.grad)
    n = len(cuts) + 1
    units = Units(cuts, {}, [0.0] * n, [0.0] * n, [0.0] * n, [set() for _ in range(n)])
    node_costs = costs(graph, analysis.trainable)
    split = {t for t, lay in prop.layouts.items() if isinstance(lay, Shard)} | set(prop.reduced) | set(prop.deferred)
    for position, node in enumerate(graph.nodes):
        k = unit_index(cuts, position)
        units.unit_of[node.name] = k
        cost = node_costs[node.name]
        share = 1.0 / tp if node.name in split else 1.0
        units.compute[k] += evaluate(cost.flops, sizes) * share
        units.activations[k] += evaluate(cost.activation_bytes, sizes) * share
        for attr in node.all_input_nodes:
            # A parameter is held by every stage that reads it (a tied embedding/head: the first and the last).
            count = node_costs[attr.name].param_count if attr.op == "get_attr" else 0
            if count and attr.name not in units.param_sets[k]:
                units.param_sets[k].add(attr.name)
                units.rank_params[k] += count / tp if isinstance(prop.layouts.get(attr.name), Shard) else count
    units.param_sizes = {n: c.param_count for n, c in node_costs.items() if c.param_count}
    return units


def forced_units(analysis, cuts: list[Cut], modules) -> list[int]:
    """The unit index at which each forced module starts a stage."""
    starts = module_starts(analysis)
    out = []
    for module in modules:
        if module not in starts:
            near = [m for m in starts if m.split(".")[-1] == module.split(".")[-1]][:3] or list(starts)[:3]
            raise PlanError(f"cannot cut at module {module!r}: the model has no module of that name with parameters "
                            f"(modules look like {', '.join(near)}); name a module to start a stage with")
        unit = unit_index(cuts, starts[module])
        if unit == 0:
            raise PlanError(f"cannot cut at module {module!r}: nothing comes before it that could form a stage; "
                            "name a later module")
        out.append(unit)
    return out


def _stage_modules(analysis, units: Units, stage_of_unit: list[int], stage: int) -> tuple[str, ...]:
    """The modules a stage holds, each named at the coarsest level that lies wholly in this stage."""
    readers = param_users(analysis.graph, analysis.trainable)
    stage_of_module: dict[str, set[int]] = {}
    for name in readers:
        path = analysis.module(name).split(".")
        for depth in range(1, len(path) + 1):
            stage_of_module.setdefault(".".join(path[:depth]), set()).add(stage_of_unit[units.unit_of[name]])
    listed: list[str] = []
    for name in readers:
        if stage_of_unit[units.unit_of[name]] != stage:
            continue
        path = analysis.module(name).split(".")
        prefixes = [".".join(path[:d]) for d in range(1, len(path) + 1)]
        whole = next((p for p in prefixes if stage_of_module.get(p) == {stage}), prefixes[-1])
        if whole and not within_any(whole, listed):
            listed.append(whole)
    return tuple(listed)


def plan_stages(analysis, prop, tp: int, pp: int, balance: Balance, sizes: dict[str, int],
                forced_modules=()) -> tuple[Stage, ...]:
    """Split the model into ``pp`` balanced stages (one stage when pp == 1)."""
    units = build_units(analysis, prop, tp, sizes)
    if pp > len(units.compute):
        after = ", ".join(analysis.module(c.value) or c.value for c in units.cuts[:6])
        raise PlanError(f"pp={pp} but {analysis.captured.model_name} can be cut in only {len(units.cuts)} places "
                        f"(after {after}{', ...' if len(units.cuts) > 6 else ''}); use pp <= {len(units.compute)}")
    forced = forced_units(analysis, units.cuts, forced_modules)
    starts = balanced_split(units.compute, units.rank_params, pp, balance, forced)
    bounds = [*starts, len(units.compute)]
    stage_of_unit = [s for s, (a, b) in enumerate(zip(bounds, bounds[1:])) for _ in range(a, b)]
    nodes = {n.name: n for n in analysis.graph.nodes}
    stages = []
    for s, (a, b) in enumerate(zip(bounds, bounds[1:])):
        boundary = tensor_bytes(nodes[units.cuts[b - 1].value], sizes) if b < len(units.compute) else 0.0
        stages.append(Stage(index=s, modules=_stage_modules(analysis, units, stage_of_unit, s),
                            flops=sum(units.compute[a:b]), param_count=units.stage_params(a, b),
                            activation_bytes=sum(units.activations[a:b]), boundary_bytes=boundary))
    return tuple(stages)
