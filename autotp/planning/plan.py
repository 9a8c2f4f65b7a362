"""The sharding plan: a frozen, JSON-serialisable value keyed by original parameter names.

The plan is the contract between the planner and the rewriter. It holds no torch objects, so it can
be printed, saved, edited by hand, loaded back and applied (see ``Plan.to_json``/``Plan.from_json``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import sympy

from autotp.errors import InputError, PlanError
from autotp.options import Balance, Options
from autotp.passes.placement import Placement, PlacementKind
from autotp.passes.region_match import RegionKind
from autotp.passes.steps import CollectiveOp, Direction, Operator
from autotp.planning.layout_cost import Prediction
from autotp.planning.plan_file import check_plan_data
from autotp.planning.shape_expr import parse_size

SCHEMA_VERSION = 1


class FrozenMap(Mapping):
    """An immutable, hashable mapping (the plan's ``placements``)."""

    def __init__(self, items=()):
        self._data = dict(items)

    def __getitem__(self, key):
        return self._data[key]

    def __iter__(self) -> Iterator:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def __hash__(self) -> int:
        return hash(frozenset(self._data.items()))  # order-free, like __eq__

    def __eq__(self, other) -> bool:
        return isinstance(other, Mapping) and dict(self) == dict(other)

    def __repr__(self) -> str:
        return f"FrozenMap({self._data!r})"


@dataclass(frozen=True)
class Collective:
    """One communication the rewrite inserts, described for people and cost models."""

    op: CollectiveOp
    direction: Direction
    """The pass in which it runs."""
    operator: Operator
    """Megatron's name for the boundary: ``f`` (copy to TP region), ``g`` (reduce from it), ..."""
    module: str
    """The original module at which it is inserted."""
    shape: tuple[str, ...]
    """Shape of the communicated tensor, with ``B``/``T``-style symbols for dynamic sizes."""
    itemsize: int = 4
    """Bytes per element."""
    in_step: bool = True
    """Whether a training step (``pm.step``) runs it: False for the gather of a model output, which the step
    defers (its loss is computed on the split output), while ``forward`` runs it."""

    def __post_init__(self):
        object.__setattr__(self, "op", CollectiveOp(self.op))
        object.__setattr__(self, "direction", Direction(self.direction))
        object.__setattr__(self, "operator", Operator(self.operator))
        object.__setattr__(self, "shape", tuple(self.shape))

    def nbytes(self, batch: int, seq: int, sizes: Mapping[str, int] | None = None) -> int:
        """Bytes this collective moves per call at the given batch size (``B``) and sequence length (``T``).

        ``sizes`` gives the other size symbols of the shape by name (an encoder-decoder's decoder length, a second
        input's sizes: the capture names only the first input's ``B`` and ``T``). A symbol left without a value
        raises ``PlanError`` naming it."""
        values = {sympy.Symbol(k): v for k, v in {**(sizes or {}), "B": batch, "T": seq}.items()}
        dims = [parse_size(dim).subs(values) for dim in self.shape]
        unknown = sorted({str(s) for d in dims for s in d.free_symbols})
        if unknown:
            raise PlanError(f"the {self.op.value} at {self.module or 'the model'} sends a tensor of shape "
                            f"[{', '.join(self.shape)}]: its size needs a value for {', '.join(unknown)} (only "
                            f"B={batch} and T={seq} were given); pass the other size symbols' values as sizes")
        count = 1
        for d in dims:
            count *= int(d)
        return count * self.itemsize

    def to_dict(self) -> dict:
        """A JSON-ready dict."""
        return {"op": self.op.value, "direction": self.direction.value, "operator": self.operator.value,
                "module": self.module, "shape": list(self.shape), "itemsize": self.itemsize, "in_step": self.in_step}


@dataclass(frozen=True)
class Region:
    """A detected block of layers sharded together (an MLP or an attention)."""

    kind: RegionKind
    columns: tuple[str, ...]
    """Modules whose weights are split along the output features (or vocabulary)."""
    rows: tuple[str, ...]
    """Modules whose weights are split along the input features."""
    replicated: tuple[str, ...] = ()
    """Modules of the region kept whole (e.g. K/V when tp does not divide the KV heads)."""

    def __post_init__(self):
        object.__setattr__(self, "kind", RegionKind(self.kind))
        for name in ("columns", "rows", "replicated"):
            object.__setattr__(self, name, tuple(getattr(self, name)))

    def to_dict(self) -> dict:
        """A JSON-ready dict."""
        return {"kind": self.kind.value, "columns": list(self.columns), "rows": list(self.rows),
                "replicated": list(self.replicated)}


@dataclass(frozen=True)
class Stage:
    """One pipeline stage: a contiguous run of the model, with its costs at the plan's batch and sequence."""

    index: int
    modules: tuple[str, ...]
    """The original modules it holds, in order (blocks as ``transformer.h.3``, plus embeddings/head)."""
    flops: float
    """Forward FLOPs of one step (whole batch) for this stage, per tensor-parallel rank."""
    param_count: int
    """Parameters this stage holds in total (across its tensor-parallel ranks)."""
    activation_bytes: float
    """Bytes of activations the stage's forward produces for one step (whole batch)."""
    boundary_bytes: float = 0.0
    """Bytes sent to the next stage per step (zero for the last stage)."""

    def to_dict(self) -> dict:
        """A JSON-ready dict."""
        return dataclasses.asdict(self) | {"modules": list(self.modules)}


@dataclass(frozen=True)
class Plan:
    """How a model is split across ``tp`` ranks: placements keyed by original parameter names."""

    tp: int
    placements: FrozenMap = field(default_factory=FrozenMap)
    collectives: tuple[Collective, ...] = ()
    regions: tuple[Region, ...] = ()
    notes: tuple[str, ...] = ()
    """Decisions a user should know about (what was replicated and why)."""
    model: str = ""
    """The class name of the planned model, for people reading the plan."""
    pp: int = 1
    """Number of pipeline stages."""
    stages: tuple[Stage, ...] = ()
    """The pipeline stages with their costs (one stage when pp == 1; pp × virtual stages when interleaved)."""
    balance: Balance = Balance.BOTH
    """What the stage split balanced."""
    batch: int = 0
    """Batch size the costs were evaluated at (0: not evaluated)."""
    seq: int = 0
    """Sequence length the costs were evaluated at."""
    by_choice: tuple[str, ...] = ()
    """Layers kept whole on purpose because that is cheaper (a transform before the LM head), not for want of a
    way to split them; the notes say why."""
    sequence_parallel: bool = False
    """Whether the residual stream between regions is split along the sequence (Megatron's sequence parallelism)."""
    options: Options | None = None
    """The options the plan was made with (None: a plan made by hand, or before plans recorded them)."""
    layouts: tuple[Prediction, ...] = ()
    """When the planner chose the layout (``layout_search``): the layouts it ranked, the chosen one first, each
    with its predicted step time and memory per device (empty: the caller gave the layout)."""

    def __post_init__(self):
        if not isinstance(self.tp, int) or self.tp < 1:
            raise ValueError(f"tp must be a positive integer, got {self.tp!r}")
        object.__setattr__(self, "placements", FrozenMap(self.placements))
        object.__setattr__(self, "collectives", tuple(self.collectives))
        object.__setattr__(self, "regions", tuple(self.regions))
        object.__setattr__(self, "notes", tuple(self.notes))
        object.__setattr__(self, "stages", tuple(self.stages))
        object.__setattr__(self, "by_choice", tuple(self.by_choice))
        object.__setattr__(self, "layouts", tuple(self.layouts))
        object.__setattr__(self, "balance", Balance(self.balance))
        if not isinstance(self.pp, int) or self.pp < 1:
            raise ValueError(f"pp must be a positive integer, got {self.pp!r}")

    def __repr__(self) -> str:
        split = sum(p.is_split for p in self.placements.values())
        sequence = ", sequence parallel" if self.sequence_parallel else ""
        return (f"Plan(model={self.model!r}, tp={self.tp}, pp={self.pp}{sequence}, {split}/{len(self.placements)} "
                f"parameters split, {len(self.regions)} regions, {len(self.collectives)} collectives)")

    def replace(self, **changes) -> Plan:
        """A new plan with ``changes`` applied (the plan itself never changes)."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        """A JSON-ready dict with the schema version."""
        return {
            "schema_version": SCHEMA_VERSION,
            "model": self.model,
            "tp": self.tp,
            "placements": {name: p.to_dict() for name, p in self.placements.items()},
            "collectives": [c.to_dict() for c in self.collectives],
            "regions": [r.to_dict() for r in self.regions],
            "notes": list(self.notes),
            "pp": self.pp,
            "balance": self.balance.value,
            "batch": self.batch,
            "seq": self.seq,
            "stages": [s.to_dict() for s in self.stages],
            "by_choice": list(self.by_choice),
            "sequence_parallel": self.sequence_parallel,
            "options": self.options.to_dict() if self.options is not None else None,
            "layouts": [p.to_dict() for p in self.layouts],
        }

    def to_json(self, indent: int | None = 2) -> str:
        """The plan as JSON text."""
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_dict(cls, data: dict) -> Plan:
        """Rebuild a plan from ``to_dict``'s output."""
        if not isinstance(data, dict):
            raise InputError(f"not a valid autotp plan: expected a JSON object, got {type(data).__name__}")
        version = data.get("schema_version")
        if version != SCHEMA_VERSION:
            raise InputError(f"plan schema_version is {version!r}; this autotp reads version {SCHEMA_VERSION}")
        check_plan_data(data)  # every field's type and range, named; sizes parsed, never evaluated
        try:
            return cls(
                tp=data["tp"],
                model=data.get("model", ""),
                placements={n: Placement(**p) for n, p in data["placements"].items()},
                collectives=tuple(Collective(**c) for c in data.get("collectives", [])),
                regions=tuple(Region(**r) for r in data.get("regions", [])),
                notes=tuple(data.get("notes", [])),
                pp=data.get("pp", 1),
                balance=data.get("balance", "both"),
                batch=data.get("batch", 0),
                seq=data.get("seq", 0),
                stages=tuple(Stage(**st | {"modules": tuple(st["modules"])}) for st in data.get("stages", [])),
                by_choice=tuple(data.get("by_choice", [])),
                sequence_parallel=bool(data.get("sequence_parallel", False)),
                options=Options.from_dict(data["options"]) if data.get("options") is not None else None,
                layouts=tuple(Prediction.from_dict(p) for p in data.get("layouts", [])),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise InputError(f"not a valid autotp plan: {e}") from e

    @classmethod
    def from_json(cls, text: str) -> Plan:
        """Rebuild a plan from ``to_json``'s output."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise InputError(f"plan is not valid JSON: {e}") from e
        return cls.from_dict(data)

    def fingerprint(self) -> str:
        """A short hash of the plan; every rank must compute the same one (key order does not count)."""
        text = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def imbalance(self) -> dict[str, float]:
        """max/mean of per-stage compute and parameters (1.0 is perfectly balanced)."""
        def ratio(values):
            mean = sum(values) / len(values)
            return max(values) / mean if mean else 1.0
        if not self.stages:
            return {"compute": 1.0, "params": 1.0}
        return {"compute": ratio([s.flops for s in self.stages]), "params": ratio([s.param_count for s in self.stages])}

    def summary(self) -> str:
        """A short human-readable account of the plan."""
        lines = [repr(self)]
        for region in self.regions:
            kept = f" (replicated: {', '.join(region.replicated)})" if region.replicated else ""
            lines.append(f"  {region.kind.value:<10} column: {', '.join(region.columns)}  row: {', '.join(region.rows)}{kept}")
        counts: dict[tuple[str, str], int] = {}
        for c in self.collectives:
            key = (c.op.value, c.direction.value)
            counts[key] = counts.get(key, 0) + 1
        lines.append("  collectives: " + (", ".join(f"{n} {op} ({d})" for (op, d), n in sorted(counts.items())) or "none"))
        for st in self.stages:
            lines.append(f"  stage {st.index}: {st.modules[0]} .. {st.modules[-1]} ({len(st.modules)} modules), "
                         f"{st.flops / 1e9:.3g} GFLOP, {st.param_count} params")
        if self.stages:
            imb = self.imbalance()
            lines.append(f"  imbalance (max/mean): compute {imb['compute']:.3f}, params {imb['params']:.3f}")
        lines.extend(f"  note: {n}" for n in self.notes)
        return "\n".join(lines)


def check_plan_fits(plan: Plan, shapes: Mapping[str, tuple], tp: int | None = None, pp: int | None = None,
                    stages: int | None = None, source: str = "the plan") -> Plan:
    """A plan given by the user must be a ``Plan`` for this tp/pp, name only parameters the model has
    (``shapes``: name -> shape), and split each along a dim it has into equal whole shares."""
    if not isinstance(plan, Plan):
        raise InputError(f"plan must be an autotp.Plan (e.g. Plan.from_json(text)), got {type(plan).__name__}")
    asked = {"tp": tp, "pp": pp, "stages": stages}
    has = {"tp": plan.tp, "pp": plan.pp, "stages": len(plan.stages)}
    wrong = [k for k, v in asked.items() if v is not None and v != has[k]]
    if wrong:
        mine = ", ".join(f"{k}={has[k]}" for k in wrong)
        theirs = ", ".join(f"{k}={asked[k]}" for k in wrong)
        raise PlanError(f"{source} was made for {mine} but {theirs} was asked for; "
                        "re-plan, or leave these settings to the plan's")
    unknown = sorted(set(plan.placements) - set(shapes))
    if unknown:
        raise PlanError(f"{source} names parameters this model does not have: {', '.join(unknown[:5])}; "
                        "make the plan from this model (autotp.plan) or fix the names")
    for name, placement in plan.placements.items():
        why = _split_problem(placement, tuple(shapes[name]), plan.tp)
        if why:
            raise PlanError(f"{source} splits {name} (shape {list(shapes[name])}) as {placement!r}, but {why}; "
                            "fix that placement or re-plan with autotp.plan")
    return plan


def check_schedule_fits(plan: Plan, options: Options) -> Plan:
    """``plan`` run through ``options.schedule``: a schedule that splits backward (zero bubble, DualPipeV) runs
    the weight gradients later, one group of weights at a time, in an order torch takes from sets of autograd
    nodes, which is not the same on every rank; a collective on a weight's own gradient path (a KV head several
    ranks hold sums its gradient shares) would then not line up across the tensor-parallel ranks."""
    schedule = options.schedule
    if options.pp == 1 or not schedule.splits_backward:
        return plan
    shared = sorted({c.module for c in plan.collectives if c.operator is Operator.SHARED_GRAD})
    if shared:
        raise PlanError(f"schedule {schedule.value} computes weight gradients apart from input gradients, in an "
                        f"order that differs between ranks, but {', '.join(shared[:3])} sum their weights' "
                        f"gradients over the ranks holding them (tp={plan.tp} exceeds their KV heads), a collective "
                        "that must run in the same order everywhere; use schedule '1f1b' or 'interleaved1f1b', or "
                        "a tp that divides the KV heads")
    return plan


_REGION_SIDES = {"columns": (PlacementKind.COLWISE, PlacementKind.VOCAB), "rows": (PlacementKind.ROWWISE,)}


def region_contradictions(region: Region, placements: Mapping[str, Placement]) -> list[str]:
    """Why ``placements`` contradict ``region`` (empty: they agree): a layer listed as a column (or the vocabulary)
    whose weight is not placed so, or a row whose weight is not rowwise. Regions report placements; after a hand
    edit of the placements they may no longer describe them."""
    found = []
    for side, kinds in _REGION_SIDES.items():
        for layer in getattr(region, side):
            placement = placements.get(f"{layer}.weight", placements.get(layer))
            if placement is not None and placement.kind not in kinds:
                found.append(f"the {region.kind.value} region listing {layer} among its {side} (its weight is "
                             f"{placement!r})")
    return found


def _split_problem(placement: Placement, shape: tuple, tp: int) -> str | None:
    """Why ``placement`` cannot give each of ``tp`` ranks an equal whole share of a tensor of ``shape`` (or, split
    along a vocabulary tp does not divide, a share one row longer on the first ranks)."""
    if not placement.is_split:
        return None
    if not 0 <= placement.dim < len(shape):
        return f"it has no dim {placement.dim} (it has {len(shape)})"
    size = shape[placement.dim]
    parts = placement.segments or (size,)
    if sum(parts) != size:
        return f"its segments {list(parts)} do not add up to dim {placement.dim}'s size {size}"
    if tp % placement.replicas:
        return f"its {placement.replicas} replicas do not divide tp={tp}"
    chunks = placement.chunks(tp)
    if placement.kind is PlacementKind.VOCAB and len(parts) == 1 and placement.replicas == 1:
        # a vocabulary tp does not divide is cut unevenly (``chunk_span``), at least one row per rank
        return None if size >= tp else f"its {size} rows cannot give each of {tp} ranks one"
    if any(p % chunks for p in parts):
        return f"{chunks} chunks do not divide {'every segment' if placement.segments else 'its size'} {list(parts)}"
    return None
