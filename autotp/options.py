"""Typed settings shared by the library, the CLI and the pictures (one definition each): the enum choices and
``Options``, the one value holding every setting of a parallel layout."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from enum import Enum

from autotp.errors import InputError
from autotp.mixed_precision import MixedPrecision


class Balance(str, Enum):
    """What pipeline stages are balanced on (the notes: speed = min Var(compute), memory = min Var(params))."""

    COMPUTE = "compute"
    MEMORY = "memory"
    BOTH = "both"


class Schedule(str, Enum):
    """Pipeline schedules."""

    GPIPE = "gpipe"
    """All forwards, then all backwards."""
    ONE_F_ONE_B = "1f1b"
    """After a warm-up of forwards, each stage alternates one forward and one backward."""
    INTERLEAVED_1F1B = "interleaved1f1b"
    """1F1B over several (virtual) stages per rank."""
    INTERLEAVED_ZERO_BUBBLE = "interleavedzb"
    """Interleaved 1F1B with each backward split into its input and weight gradients, the weight gradients
    filling the bubbles (ZB1P of Qi et al. 2024, torch's ``ScheduleInterleavedZeroBubble``)."""
    ZBV = "zbv"
    """Zero bubble over two stages per rank placed in a V (rank r holds stages r and 2·pp-1-r; torch's
    ``ScheduleZBVZeroBubble``)."""
    DUALPIPE_V = "dualpipev"
    """DeepSeek's DualPipe on the V placement: one microbatch's forward overlapped with another's backward
    (torch's ``ScheduleDualPipeV``)."""

    @property
    def virtual(self) -> bool:
        """Whether each rank holds several stages (by default two)."""
        return self not in (Schedule.GPIPE, Schedule.ONE_F_ONE_B)

    @property
    def v_shaped(self) -> bool:
        """Whether the stages lie in a V: exactly two per rank, the first and last on rank 0."""
        return self in (Schedule.ZBV, Schedule.DUALPIPE_V)

    @property
    def splits_backward(self) -> bool:
        """Whether backward runs as input gradients, then weight gradients later (torch's
        ``stage_backward_input``/``stage_backward_weight``)."""
        return self in (Schedule.INTERLEAVED_ZERO_BUBBLE, Schedule.ZBV, Schedule.DUALPIPE_V)

    def rank_of(self, stage: int, pp: int) -> int:
        """The pipeline rank holding ``stage``: looped (``stage % pp``), or down and back up a V."""
        lap, offset = divmod(stage, pp)
        return pp - 1 - offset if self.v_shaped and lap % 2 else offset


class DataParallelMode(str, Enum):
    """How data-parallel replicas hold the model."""

    FSDP = "fsdp"
    """Parameters, gradients and optimizer state sharded over the replicas (torch's FSDP2 ``fully_shard``)."""
    REPLICATE = "replicate"
    """Every replica holds the whole rank module; gradients are averaged by all-reduce (as DDP)."""


class Recompute(str, Enum):
    """Which activations backward recomputes instead of keeping (``rewrite.recompute``)."""

    NONE = "none"
    """Keep every activation."""
    BLOCKS = "blocks"
    """Keep each block's input only (blocks: the runs between pipeline cut candidates) and run the block's
    forward again in backward, with the same dropout masks; the model's last block (the head) is kept."""


class VocabChoice(str, Enum):
    """Whether the token embedding and LM head are split along the vocabulary."""

    AUTO = "auto"
    """As the cost model finds faster, within the memory budget (``autotp.planning.pricing``)."""
    SPLIT = "split"
    """Always (Megatron's choice)."""
    WHOLE = "whole"
    """Never: every rank holds both tables whole."""


class ContextExchange(str, Enum):
    """How attention exchanges keys and values across the cp ranks (docs/context-parallelism.md)."""

    AUTO = "auto"
    """Per attention, the fastest method that keeps its keys and values within the memory the cost model allows
    (``autotp.planning.context_exchange``)."""
    ALL_GATHER = "all_gather"
    """Every rank gathers the whole keys and values (least bytes; holds them whole)."""
    RING = "ring"
    """Key/value blocks passed around the ring, merged by running softmax statistics (holds one block)."""
    ULYSSES = "ulysses"
    """All-to-all from sequence to heads and back (where cp divides the KV heads)."""


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(budget: int | float | str | None) -> int | None:
    """A memory budget in bytes: a number, or a string such as ``"40GiB"`` or ``"500 MB"``; None: no budget."""
    if budget is None:
        return None
    if isinstance(budget, (int, float)) and not isinstance(budget, bool) and budget > 0:
        return int(budget)
    match = re.fullmatch(r"\s*([0-9.]+)\s*([a-zA-Z]*)\s*", budget) if isinstance(budget, str) else None
    if match is None or match.group(2).lower() not in _UNITS:
        raise InputError(f"memory_budget must be a positive number of bytes or a size such as '40GiB' or '500MB', "
                         f"got {budget!r}")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


_MEANING = {"tp": "the number of tensor-parallel ranks", "pp": "the number of pipeline stages' ranks",
            "virtual_stages": "pipeline stages per rank", "microbatches": "microbatches per step",
            "dp": "the number of data-parallel replicas", "batch": "the batch size costs are evaluated at",
            "seq": "the sequence length costs are evaluated at",
            "ep": "the number of expert-parallel ranks, among which the routed experts are divided",
            "cp": "the number of context-parallel ranks"}


def _positive(name: str, value, optional: bool = False) -> int | None:
    if optional and value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InputError(f"{name} must be a positive integer ({_MEANING[name]}), got {value!r}")
    return value


def _member(kind: type[Enum], name: str, value):
    """``value`` as a member of the enum ``kind``, or an ``InputError`` listing the choices."""
    try:
        return kind(value)
    except ValueError as e:
        raise InputError(f"{name} must be one of {[c.value for c in kind]}, got {value!r}") from e


NOT_RECORDED = ("capture_speedups",)
"""Options of how a model is captured, not of its layout: a plan's JSON leaves them out."""


def capture_speedups(options: Options | None, settings: dict) -> bool | None:
    """The ``capture_speedups`` a call's keyword ``settings`` or ``options`` give (None: neither sets it), read
    before the rest of the options are built, since the model is captured first."""
    given = settings.get("capture_speedups")
    return given if given is not None else getattr(options, "capture_speedups", None)


def _flag(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise InputError(f"{name} must be True or False, got {value!r}")
    return value


def _shown(value):
    return value.value if isinstance(value, Enum) else value


def _check_schedule(options: Options) -> None:
    """The layouts torch's schedules take: V schedules hold exactly two stages per rank; the looped ones split
    the microbatches into rounds of ``pp``."""
    schedule, pp, micro = options.schedule, options.pp, options.step_microbatches
    if pp == 1:
        return
    if schedule.v_shaped and options.stages_per_rank != 2:
        raise InputError(f"schedule {schedule.value} places exactly 2 stages per rank in a V, got "
                         f"virtual_stages={options.virtual_stages}; leave virtual_stages unset (or 2)")
    if schedule.splits_backward and options.dp > 1:
        raise InputError(f"schedule {schedule.value} (input and weight gradients apart) is not verified with data "
                         f"parallelism (dp={options.dp}): FSDP and the replicas' all-reduce expect one backward per "
                         "microbatch; use schedule '1f1b' or 'interleaved1f1b' with dp > 1")
    rounds = max(1, micro // pp)
    if schedule.virtual and not schedule.v_shaped and micro % rounds:
        raise InputError(f"schedule {schedule.value} runs microbatches in rounds of pp={pp}: microbatches="
                         f"{micro} must be a multiple of {rounds} (microbatches // pp); use a multiple of pp")


def _check_context(options) -> None:
    """cp > 1 runs with the settings it is tested with: the others are refused, naming them."""
    if options.cp == 1:
        return
    others = []
    others += [name for name in ("sequence_parallel", "compile") if getattr(options, name)]
    if others:
        raise InputError(f"cp={options.cp} (context parallelism) runs with tp, dp, pp and recompute, not yet with "
                         f"{', '.join(others)}: sequence parallelism would split each cp chunk again over tp, which "
                         "the sequence rewrite does not follow, and torch.compile recompiles the exchanges until "
                         "its recompile limit; drop those settings, or leave cp at 1")
    if options.ep not in (1, options.tp):
        # the cp mesh builds no expert-parallel groups of its own: at ep = tp the tp group dispatches the tokens
        raise InputError(f"cp={options.cp} runs expert parallelism at ep = tp only (ep={options.ep}, tp="
                         f"{options.tp}): the (dp x cp x tp) mesh has no expert groups across replicas; set ep to "
                         f"{options.tp} or 1, or leave cp at 1")


@dataclass(frozen=True, repr=False)
class Options:
    """Every setting of a parallel layout, validated once: ``parallelize``, ``plan``, ``check`` and the CLI
    build one (their keyword arguments are a convenience for it) and pass it down; a plan records the options
    it was made with. ``Options(tp=2, vocab="split")``; ``options.replace(pp=2)`` gives a new one.
    A bad value raises ``InputError`` naming the setting and what it takes."""

    tp: int = 1
    """Tensor-parallel ranks."""
    pp: int = 1
    """Pipeline-parallel ranks."""
    dp: int = 1
    """Data-parallel replicas (a runtime layout: the plan is the same for any dp)."""
    cp: int = 1
    """Context-parallel ranks: every sequence is split across them for the whole model (each rank computes its
    own 2 of ``2 * cp`` chunks; attention all-gathers keys and values). Each rank of a cp group is given the same
    batch and returns the whole output. With tp, dp or pp, ranks lie on a (pp x dp x cp x tp) mesh, tp innermost.
    The sequence must be a multiple of ``2 * cp``."""
    cp_exchange: ContextExchange = ContextExchange.AUTO
    """How each attention exchanges keys and values across the cp ranks: ``"all_gather"``, ``"ring"``,
    ``"ulysses"`` (where cp divides the KV heads), or ``"auto"``, the cost model's choice per attention; an
    attention the chosen method cannot take falls back to all-gather, and the plan's notes say so."""
    dp_mode: DataParallelMode = DataParallelMode.FSDP
    """How the replicas hold the model."""
    ep: int = 1
    """Expert-parallel ranks: the routed experts of every mixture-of-experts layer divided among ``ep`` ranks
    taken from the data- and tensor-parallel ranks (Megatron's expert-model-parallel group), so ``ep`` divides
    ``dp × tp``. A layer whose experts cannot be expert-split keeps them under tensor parallelism, and the plan's
    notes say so (docs/expert-parallelism.md)."""
    virtual_stages: int | None = None
    """Pipeline stages per rank (None: 2 for the interleaved, zero-bubble and V schedules, else 1)."""
    microbatches: int | None = None
    """Microbatches per pipelined step (None: one per stage)."""
    schedule: Schedule = Schedule.ONE_F_ONE_B
    """The pipeline schedule."""
    balance: Balance = Balance.BOTH
    """What the stage split balances."""
    cuts: tuple[str, ...] = ()
    """Modules at which a pipeline stage must start."""
    batch: int | None = None
    """Batch size the costs are evaluated at (None: the example's)."""
    seq: int | None = None
    """Sequence length the costs are evaluated at (None: the example's)."""
    vocab: VocabChoice = VocabChoice.AUTO
    """Whether the embedding and LM head are split along the vocabulary."""
    memory_budget: int | None = None
    """Bytes per rank for parameters, gradients and AdamW moments (a number or ``"40GiB"``); None: no limit. When
    the planner chooses the layout it is each device's memory, activations included (None: the machine's)."""
    sequence_parallel: bool = False
    """Split the residual stream between regions along the sequence (Megatron's sequence parallelism)."""
    compile: bool = False
    """Run the rank graphs under ``torch.compile`` (tensor parallelism only)."""
    recompute: Recompute = Recompute.NONE
    """Activations recomputed in backward instead of kept (a runtime choice: the plan is the same)."""
    mixed_precision: MixedPrecision | None = None
    """The dtypes the module computes, casts its parameters and reduces gradients in over fp32 master weights
    (``autotp.MixedPrecision``; also a dtype, for that compute dtype, or FSDP2's ``MixedPrecisionPolicy``);
    None: as the model's tensors are. A runtime choice: the splits are the same."""
    capture_speedups: bool | None = dataclasses.field(default=None, compare=False)
    """Capture with the capture's speed-ups (shape-only kernels, values computed once, tracing switches, block
    stamping) or without any (False): the same graph and plan either way, without them slower; the way out if one
    breaks on a new torch release. None: the ``AUTOTP_CAPTURE_SPEEDUPS`` environment variable decides (``0``,
    ``false``, ``no`` or ``off`` turn them off; unset, on). How the model is captured, not part of the layout: a
    plan does not record it, and options that differ only in it are equal."""

    def __post_init__(self):
        for name in ("tp", "pp", "dp", "ep", "cp"):
            _positive(name, getattr(self, name))
        if (self.dp * self.tp) % self.ep:
            raise InputError(f"ep={self.ep} must divide dp x tp = {self.dp} x {self.tp} = {self.dp * self.tp}: the "
                             "expert-parallel ranks are taken from the data- and tensor-parallel ranks; use an ep "
                             f"that divides {self.dp * self.tp}, or raise tp or dp")
        for name in ("virtual_stages", "microbatches", "batch", "seq"):
            _positive(name, getattr(self, name), optional=True)
        for name, kind in (("dp_mode", DataParallelMode), ("schedule", Schedule), ("balance", Balance),
                           ("vocab", VocabChoice), ("recompute", Recompute),
                           ("cp_exchange", ContextExchange)):
            object.__setattr__(self, name, _member(kind, name, getattr(self, name)))
        for name in ("sequence_parallel", "compile"):
            _flag(name, getattr(self, name))
        if self.capture_speedups is not None:
            _flag("capture_speedups", self.capture_speedups)
        if isinstance(self.cuts, str) or not all(isinstance(c, str) for c in self.cuts):
            raise InputError(f"cuts must be a list of module names, got {self.cuts!r}")
        object.__setattr__(self, "cuts", tuple(self.cuts))
        object.__setattr__(self, "memory_budget", parse_bytes(self.memory_budget))
        object.__setattr__(self, "mixed_precision", MixedPrecision.of(self.mixed_precision))
        if self.pp > 1 and self.schedule is not Schedule.GPIPE and self.step_microbatches < self.stages:
            raise InputError(f"schedule {self.schedule.value} needs at least {self.stages} microbatches (one per "
                             f"stage) to fill the pipeline, got microbatches={self.microbatches}; raise microbatches "
                             "or use schedule='gpipe'")
        _check_schedule(self)
        _check_context(self)
        if self.compile and self.recompute is not Recompute.NONE:
            raise InputError(f"recompute={self.recompute.value!r} with compile=True is not verified: torch.compile "
                             "would trace the recomputed blocks' random-stream replay; use one or the other")
        if self.compile and (self.pp > 1 or self.dp > 1):
            raise InputError(f"compile=True runs tensor-parallel graphs (pp=1, dp=1) under torch.compile; with "
                             f"pp={self.pp} and dp={self.dp} the pipeline schedule and FSDP's hooks wrap them: leave "
                             "compile off there")

    @classmethod
    def build(cls, base: Options | None = None, **settings) -> Options:
        """``base`` (default: the defaults) with ``settings`` applied; a name that is no setting is refused,
        with the list of settings; a setting given as None keeps ``base``'s."""
        if base is not None and not isinstance(base, Options):
            raise InputError(f"options must be an autotp.Options, got {type(base).__name__}")
        unknown = sorted(set(settings) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise InputError(f"unknown setting(s) {', '.join(unknown)}; the settings are: "
                             f"{', '.join(f.name for f in dataclasses.fields(cls))}")
        given = {k: v for k, v in settings.items() if v is not None}
        return dataclasses.replace(base, **given) if base is not None else cls(**given)

    def __repr__(self) -> str:
        changed = [f"{f.name}={_shown(getattr(self, f.name))!r}" for f in dataclasses.fields(self)
                   if getattr(self, f.name) != f.default]
        return f"Options({', '.join(changed)})"

    def replace(self, **changes) -> Options:
        """A new value with ``changes`` applied (validated again)."""
        return dataclasses.replace(self, **changes)

    @property
    def stages_per_rank(self) -> int:
        """Pipeline stages each pipeline rank holds."""
        default = 2 if self.schedule.virtual else 1
        return self.virtual_stages or default

    @property
    def stages(self) -> int:
        """Pipeline stages in all (pp × stages per rank)."""
        return self.pp * self.stages_per_rank

    @property
    def step_microbatches(self) -> int:
        """Microbatches per pipelined step (default: one per stage)."""
        return self.microbatches or self.stages

    def to_dict(self) -> dict:
        """A JSON-ready dict (enums as their values)."""
        out = {}
        for f in dataclasses.fields(self):
            if f.name in NOT_RECORDED:
                continue
            value = getattr(self, f.name)
            out[f.name] = value.value if isinstance(value, Enum) else list(value) if isinstance(value, tuple) else \
                value.to_dict() if isinstance(value, MixedPrecision) else value
        return out

    @classmethod
    def from_dict(cls, data) -> Options:
        """Options from ``to_dict``'s output (a plan file's, which may be hand-edited: every value is validated,
        an unknown name refused)."""
        if not isinstance(data, dict):
            raise InputError(f"options must be a JSON object, got {type(data).__name__}")
        unknown = sorted(set(data) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise InputError(f"unknown option(s) {', '.join(map(str, unknown))}")
        return cls(**data)
