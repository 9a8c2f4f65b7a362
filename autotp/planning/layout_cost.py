"""What one layout (tp, pp, dp, microbatches, schedule, ...) is predicted to cost: pure functions over a model's
``Profile`` at one tp (its units' compute, parameters, activations and collectives, from the analysis' costs) and a
``machines.Machine``; no torch here, so a layout for 1024 devices is priced in microseconds.

Step time = the fullest pipeline rank's compute (forward and backward: 3x the forward FLOPs, and 3x its ops per
microbatch at the machine's fixed cost per op) and tensor-parallel
collectives over its share of the batch, + the pipeline bubble ((pp-1)/(v*m) of that, every schedule: GPipe and
1F1B idle alike, interleaving divides it by the v stages per rank), + point-to-point sends of the stage
boundaries, + the data-parallel gradient collectives, + context parallelism's K/V exchange and gradient sum
(``context_cost``; cp divides compute and activations as dp does, but over one sequence's tokens), + at ep > 1 the
experts' all-to-alls (``expert_cost``). Nothing is taken to overlap (autotp's runtime overlaps
little), which over-prices communication on GPUs where it does.

Memory per device = the rank's parameters, gradients and AdamW moments (``pricing.TRAINING_COPIES``; fsdp shards
them over dp but holds a whole unit's parameters and gradients while it runs) + the activations of the
microbatches in flight: all m for GPipe, min(m, pp) for 1F1B, and interleaving's (1 + (pp-1)/(pp*v)) more
(Narayanan et al. 2021).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from autotp.options import DataParallelMode, Recompute, Schedule
from autotp.passes.steps import CollectiveOp
from autotp.planning.context_cost import exchange_memory, exchange_time, grad_sum_time, ring_chosen
from autotp.planning.expert_cost import ALL_TO_ALLS, MoeLayer, dispatch_bytes, slowdown_flops
from autotp.planning.machines import Link, Machine
from autotp.planning.pricing import TRAINING_COPIES
from autotp.planning.unit_index import UnitIndex, index_of


@dataclass(frozen=True)
class Profile:
    """A model's costs at one tp (and sequence parallelism) per unit between pipeline cut candidates, for the
    global batch: what every layout at that tp is priced from."""

    tp: int
    sequence_parallel: bool
    compute: tuple[float, ...]
    """Forward FLOPs per tensor-parallel rank, per unit."""
    params: tuple[float, ...]
    """Parameter elements per tensor-parallel rank, per unit."""
    activations: tuple[float, ...]
    """Activation bytes per tensor-parallel rank, per unit."""
    boundaries: tuple[float, ...]
    """Bytes of the value live at each cut (between unit i and i+1)."""
    collectives: tuple[tuple[CollectiveOp, float, int], ...]
    """The tensor-parallel collectives of one training step: (op, bytes for the global batch, unit)."""
    itemsize: int
    """Bytes per parameter element."""
    vocab_split: bool
    """Whether the plan at this tp splits the vocabulary (the cost model's choice under vocab='auto')."""
    ops: tuple[float, ...] = ()
    """Ops per unit in one forward (each costs the machine's ``op_overhead`` per microbatch; empty: none)."""
    recomputed: tuple[float, ...] = ()
    """Activation bytes per tensor-parallel rank, per unit, that ``Recompute.BLOCKS`` no longer keeps (its
    activations less its output, ``recompute_cost.units_cost``; the last unit, kept, 0). Empty: not offered."""
    kv: tuple[float, ...] = ()
    """Bytes of the keys and values each unit's attention would exchange under context parallelism (the whole
    sequence, the global batch, one tensor-parallel rank's heads). Empty: cp is not offered (nothing to split
    along a sequence, or an op that cannot be)."""
    seq: int = 0
    """The sequence length the costs are evaluated at (cp must cut it in ``2 * cp`` equal chunks)."""
    moe: tuple[MoeLayer, ...] = ()
    """The mixture-of-experts layers, what expert parallelism divides (``expert_cost``); empty: none."""


@dataclass(frozen=True)
class Layout:
    """One way to lay a model out on ``tp * cp * pp * dp`` devices."""

    tp: int
    pp: int
    dp: int
    dp_mode: DataParallelMode = DataParallelMode.FSDP
    schedule: Schedule = Schedule.ONE_F_ONE_B
    microbatches: int = 1
    virtual_stages: int = 1
    sequence_parallel: bool = False
    recompute: Recompute = Recompute.NONE
    cp: int = 1
    """Context-parallel ranks each sequence is split across (from the tp x cp x dp ranks)."""
    ep: int = 1
    """Expert-parallel ranks among which the routed experts are divided (from the dp x tp ranks)."""

    def __post_init__(self):
        object.__setattr__(self, "dp_mode", DataParallelMode(self.dp_mode))
        object.__setattr__(self, "schedule", Schedule(self.schedule))
        object.__setattr__(self, "recompute", Recompute(self.recompute))

    def settings(self) -> dict:
        """The ``Options`` fields this layout fixes (pipeline settings only where there is a pipeline)."""
        out = {"tp": self.tp, "pp": self.pp, "dp": self.dp, "dp_mode": self.dp_mode,
               "sequence_parallel": self.sequence_parallel, "recompute": self.recompute, "cp": self.cp,
               "ep": self.ep}
        if self.pp > 1:
            out |= {"schedule": self.schedule, "microbatches": self.microbatches,
                    "virtual_stages": self.virtual_stages}
        return out

    def label(self) -> str:
        """``tp2 pp2 dp1 1f1b m4`` for tables (`` ep4`` after tp: experts divided among 4 ranks; `` sp``: sequence
        parallel, `` rc``: blocks recomputed)."""
        pipe = f" {self.schedule.value} m{self.microbatches}" + (f" v{self.virtual_stages}" if self.virtual_stages > 1
                                                                 else "") if self.pp > 1 else ""
        data = f" {self.dp_mode.value}" if self.dp > 1 else ""
        context = f" cp{self.cp}" if self.cp > 1 else ""
        experts = f" ep{self.ep}" if self.ep > 1 else ""
        return (f"tp{self.tp}{experts}{context} pp{self.pp} dp{self.dp}{data}{pipe}" + (" sp" if self.sequence_parallel else "")
                + (" rc" if self.recompute is not Recompute.NONE else ""))


@dataclass(frozen=True)
class Prediction:
    """A layout's predicted step time (seconds, split into its parts) and memory per device (bytes)."""

    layout: Layout
    step_time: float
    compute: float
    tp_comm: float
    bubble: float
    p2p: float
    dp_comm: float
    memory: int
    fits: bool
    vocab_split: bool = False
    cp_comm: float = 0.0
    """Seconds of context parallelism's exchanges and gradient sum (``context_cost``)."""
    ep_comm: float = 0.0
    """Seconds of the experts' all-to-alls (dispatch and combine) on the fullest pipeline rank."""

    def to_dict(self) -> dict:
        """A JSON-ready dict (the plan's ``layouts`` entries)."""
        layout = {k: v.value if hasattr(v, "value") else v for k, v in dataclasses.asdict(self.layout).items()}
        times = {k: getattr(self, k) for k in ("step_time", "compute", "tp_comm", "bubble", "p2p", "dp_comm",
                                               "cp_comm", "ep_comm")}
        return layout | times | {"memory": self.memory, "fits": self.fits, "vocab_split": self.vocab_split}

    @classmethod
    def from_dict(cls, data: dict) -> Prediction:
        """From ``to_dict``'s output (checked first by ``plan_file``)."""
        names = {f.name for f in dataclasses.fields(Layout)}
        return cls(Layout(**{k: v for k, v in data.items() if k in names}),
                   **{k: v for k, v in data.items() if k not in names})


def stage_bounds(starts: list[int], units: int) -> list[tuple[int, int]]:
    """``(start, stop)`` unit ranges of the stages starting at ``starts``."""
    ends = [*starts[1:], units]
    return list(zip(starts, ends))


def _index(profile: Profile) -> UnitIndex:
    """``profile``'s collectives and MoE layers by unit (built once per profile)."""
    return index_of(profile)


def _tp_time(profile: Profile, link: Link, share: float, calls: int, units: range) -> float:
    """Seconds of the tensor-parallel collectives of ``units`` in one step over ``share`` of the global batch,
    each run in ``calls`` calls (one per microbatch): the latency per call, the bytes once."""
    if profile.tp == 1:
        return 0.0
    count, reduced, gathered = _index(profile).collectives_in(units)
    if not count:
        return 0.0
    # a collective's price is linear in its bytes (machines.Link): priced from the stage's count and byte sums
    bytes_time = (link.all_reduce(reduced * share, profile.tp) - link.latency
                  + link.all_gather(gathered * share, profile.tp) - link.latency)
    return count * calls * link.latency + bytes_time


def _dp_time(layout: Layout, grad_bytes: float, link: Link) -> float:
    """Seconds of data-parallel collectives per step: replicate all-reduces the gradients once; fsdp all-gathers
    the parameters before every forward and backward of a microbatch, and reduce-scatters the gradients once."""
    if layout.dp == 1:
        return 0.0
    if layout.dp_mode is DataParallelMode.REPLICATE:
        return link.all_reduce(grad_bytes, layout.dp)
    gathers = 2 * layout.microbatches if layout.pp > 1 else 2
    return (gathers + 1) * link.all_gather(grad_bytes, layout.dp)


def _expert_split(profile: Profile, layout: Layout, a: int, b: int) -> tuple[float, float]:
    """(parameter elements per rank, of them the routed experts') of the units ``a:b`` at the layout's ep: at ep > 1
    the experts are whole, ``E / ep`` per rank, in place of the profile's ``1 / tp`` of each."""
    params = sum(profile.params[a:b])
    if layout.ep == 1:
        return params, 0.0
    moe = list(_index(profile).moe_in(range(a, b)))
    return params - sum(m.rank_params for m in moe), sum(m.params for m in moe) / layout.ep


def _expert_group(layout: Layout) -> Layout:
    """The layout the experts' gradients and states are reduced and sharded over: the dp x tp / ep ranks that hold
    the same experts (their data-parallel group). Above tp FSDP leaves the experts whole on their ranks (the
    runtime all-reduces their gradients over that group, as replicas do)."""
    mode = DataParallelMode.REPLICATE if layout.ep > layout.tp else layout.dp_mode
    return dataclasses.replace(layout, dp=layout.dp * layout.tp // layout.ep, dp_mode=mode)


def _ep_time(profile: Profile, layout: Layout, link: Link, units: range) -> float:
    """Seconds of the experts' all-to-alls of ``units`` in one step (none at ep=1)."""
    if layout.ep == 1:
        return 0.0
    m = layout.microbatches
    return sum(ALL_TO_ALLS * m * link.all_to_all(dispatch_bytes(layer, layout.tp, layout.dp, m, profile.itemsize),
                                                 layout.ep)
               for layer in _index(profile).moe_in(units))


def _expert_slowdown(profile: Profile, layout: Layout, tile: int, units: range) -> float:
    """Forward FLOPs per rank the expert matmuls' tile efficiency adds in ``units`` (``expert_cost``)."""
    return sum(slowdown_flops(layer, layout.tp, layout.ep, layout.dp, layout.microbatches, tile)
               for layer in _index(profile).moe_in(units))


def _in_flight(layout: Layout) -> float:
    """Microbatches whose activations a pipeline rank holds at its peak."""
    m, pp, v = layout.microbatches, layout.pp, layout.virtual_stages
    if layout.pp == 1 or layout.schedule is Schedule.GPIPE:
        return m
    held = min(m, pp)
    return min(m, held * (1 + (pp - 1) / (pp * v))) if layout.schedule.virtual else held


def _state_bytes(layout: Layout, param_bytes: float) -> float:
    """Parameters, gradients and AdamW moments of one rank: fsdp divides them by dp but gathers a unit's whole
    parameters and gradients while it runs (a rank's module is one unit)."""
    if layout.dp == 1 or layout.dp_mode is DataParallelMode.REPLICATE:
        return param_bytes * TRAINING_COPIES
    return param_bytes * TRAINING_COPIES / layout.dp + 2 * param_bytes


def _recompute_extra(profile: Profile, layout: Layout, a: int, b: int) -> tuple[float, float, float, float]:
    """(forward FLOPs, ops, bytes no longer kept, the largest unit's activations) that recompute adds or saves in
    the stage of units ``a:b``: every unit but the model's last runs its forward again in backward, keeping only
    its input; backward holds one recomputed unit's activations at a time."""
    if layout.recompute is Recompute.NONE or not profile.recomputed:
        return 0.0, 0.0, 0.0, 0.0
    again = range(a, min(b, len(profile.compute) - 1))
    return (sum(profile.compute[k] for k in again), sum(profile.ops[k] for k in again) if profile.ops else 0.0,
            sum(profile.recomputed[a:b]), max((profile.activations[k] for k in again), default=0.0))


def shared_cores(busy: list[float], fullest: int, slices: int, bubble: float, ranks: int,
                 cores: float | None) -> tuple[float, float]:
    """(compute, bubble) of the fullest pipeline rank when ``ranks`` ranks time-share ``cores`` cores (None: a
    device each, nothing shared: its own compute and ``bubble``, its idle time on dedicated devices).

    Sharing serialises every rank's compute onto the cores, so the step's compute takes at least all of it over
    the cores; and a rank idling in a bubble gives its core to another rank, so the step takes the longer of that
    and the pipeline's critical path: the fullest rank's compute plus the others' share of one of the ``slices``
    (microbatches times stages per rank) it waits for while the pipeline fills and drains. ``busy``: each
    pipeline rank's compute (every one of the ``ranks / len(busy)`` ranks at a pipeline position alike)."""
    if cores is None or ranks <= cores:
        return busy[fullest], bubble
    compute = max(busy[fullest], sum(busy) * (ranks / len(busy)) / cores)
    path = busy[fullest] + (sum(busy) - busy[fullest]) / slices
    return compute, max(0.0, path - compute)


def predict(profile: Profile, layout: Layout, starts: list[int], machine: Machine,
            budget: int | None) -> Prediction:
    """The predicted step time and memory of ``layout`` with pipeline stages starting at units ``starts`` (stage
    ``s`` on pipeline rank ``s % pp``), on ``machine``, against ``budget`` bytes per device (None: the machine's)."""
    tp, pp, dp, m, v = layout.tp, layout.pp, layout.dp, layout.microbatches, layout.virtual_stages
    cp = layout.cp
    share = dp * cp  # each rank computes its replica's rows and its cp chunk of their tokens
    ring = ring_chosen(tuple(k / dp for k in profile.kv), cp, budget)  # as cp_exchange="auto" would run it
    stages = stage_bounds(starts, len(profile.compute))
    tp_link, cp_link, dp_link = machine.ring(tp, 1), machine.ring(cp, tp), machine.ring(dp, tp * cp)
    pp_link = machine.link(pp, tp * cp * dp)
    ep_link, edp_link = machine.link(layout.ep, 1), machine.ring(tp * dp // layout.ep, layout.ep)
    busy, param_bytes, act_bytes = [0.0] * pp, [0.0] * pp, [0.0] * pp
    comm, transient, exchange = [0.0] * pp, [0.0] * pp, [0.0] * pp
    expert_bytes, ep_comm = [0.0] * pp, [0.0] * pp
    for s, (a, b) in enumerate(stages):
        again, again_ops, saved, largest = _recompute_extra(profile, layout, a, b)
        # The expert matmuls' slowdown is per rank already (their FLOPs divided by tp x dp).
        flops = sum(profile.compute[a:b]) + _expert_slowdown(profile, layout, machine.node.tile, range(a, b)) * share
        rank = s % pp
        # Backward runs about two ops per forward op, once per microbatch.
        busy[rank] += machine.node.compute((3 * flops + again) / share, m * (3 * sum(profile.ops[a:b]) + again_ops))
        comm[rank] += _tp_time(profile, tp_link, 1 / share, m, range(a, b))
        ep_comm[rank] += _ep_time(profile, layout, ep_link, range(a, b))
        dense, experts = _expert_split(profile, layout, a, b)
        param_bytes[rank] += dense * profile.itemsize
        expert_bytes[rank] += experts * profile.itemsize
        act_bytes[rank] += (sum(profile.activations[a:b]) - saved) / share
        transient[rank] = max(transient[rank], largest / share)
        kv = profile.kv[a:b] if cp > 1 and profile.kv else ()
        exchange[rank] += sum(m * exchange_time(k / (dp * m), cp, cp_link, ring) for k in kv)
        act_bytes[rank] += sum(exchange_memory(k / dp, cp, ring) for k in kv)
    fullest = max(range(pp), key=lambda r: busy[r] + comm[r] + exchange[r] + ep_comm[r])
    work = busy[fullest] + comm[fullest] + exchange[fullest] + ep_comm[fullest]
    compute, bubble = shared_cores(busy, fullest, v * m, work * (pp - 1) / (v * m), tp * cp * pp * dp,
                                   machine.cores)
    boundary = max((profile.boundaries[b - 1] for _, b in stages[:-1]), default=0.0) / share
    p2p = 2 * v * (m * pp_link.latency + boundary / pp_link.bandwidth) if pp > 1 else 0.0
    experts = _expert_group(layout)
    dp_comm = max(_dp_time(layout, param_bytes[r], dp_link)
                  + (_dp_time(experts, expert_bytes[r], edp_link) if expert_bytes[r] else 0.0) for r in range(pp))
    cp_comm = exchange[fullest] + max(m * grad_sum_time(param_bytes[r] + expert_bytes[r], cp, cp_link)
                                      for r in range(pp))
    memory = max(_state_bytes(layout, param_bytes[r]) + _state_bytes(experts, expert_bytes[r])
                 + (act_bytes[r] * _in_flight(layout) + transient[r]) / m for r in range(pp))
    limit = budget if budget is not None else machine.device_memory
    step = compute + comm[fullest] + ep_comm[fullest] + bubble + p2p + dp_comm + cp_comm
    return Prediction(layout, step, compute, comm[fullest], bubble, p2p, dp_comm, int(memory),
                      limit is None or memory <= limit, profile.vocab_split, cp_comm, ep_comm[fullest])


def ranked(predictions: list[Prediction]) -> list[Prediction]:
    """Fitting layouts first, fastest first; among equal times the fewest pipeline stages and tp ranks (less
    to go wrong), then the least memory."""
    return sorted(predictions, key=lambda p: (not p.fits, round(p.step_time, 12), p.layout.pp, p.layout.tp,
                                              p.layout.ep, p.memory, p.layout.label()))
