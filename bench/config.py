"""What one benchmark run measures: typed settings, with presets for the full run and for ``--quick``."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

import torch

SECTIONS = ("runtime", "comm", "memory", "prep", "pipeline")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class ModelShape:
    """An examples.gpt.GPT and the batch it is stepped on."""

    n_layer: int
    n_head: int
    n_embd: int
    vocab_size: int
    batch: int
    seq: int
    block_size: int = 1024
    """Rows of the learned position table (GPT-2: 1024); must be at least ``seq``."""

    def __post_init__(self):
        if self.n_embd % self.n_head:
            raise ValueError(f"n_head ({self.n_head}) must divide n_embd ({self.n_embd})")
        if self.seq > self.block_size:
            raise ValueError(f"seq ({self.seq}) is longer than block_size ({self.block_size}); raise block_size")

    def gpt_kwargs(self) -> dict:
        """Arguments for ``examples.gpt.build_gpt`` (dropout off: timing and exactness need it off)."""
        return dict(n_layer=self.n_layer, n_head=self.n_head, n_embd=self.n_embd, vocab_size=self.vocab_size,
                    block_size=self.block_size, dropout=0.0)

    def describe(self) -> str:
        """``L=12 H=12 D=768 V=50304, B=1 T=256``."""
        return (f"L={self.n_layer} H={self.n_head} D={self.n_embd} V={self.vocab_size}, "
                f"B={self.batch} T={self.seq}")

    def with_(self, **changes) -> ModelShape:
        """A copy with ``changes``."""
        return dataclasses.replace(self, **changes)


GPT2_SMALL = ModelShape(n_layer=12, n_head=12, n_embd=768, vocab_size=50304, batch=1, seq=256)
"""GPT-2 small with nanoGPT's vocabulary padded from 50257 to 50304 (a multiple of 64; tp divides it)."""
TINY = ModelShape(n_layer=2, n_head=4, n_embd=64, vocab_size=512, batch=2, seq=32, block_size=64)


@dataclass(frozen=True)
class BenchConfig:
    """Settings of one run; ``make_config`` fills them from the command line."""

    device: Literal["cpu", "cuda"] = "cpu"
    """Where the ranks compute: CPU processes over gloo, or one GPU per rank over NCCL."""
    dtype: Literal["fp32", "bf16"] = "fp32"
    """Parameter and activation dtype of every variant."""
    tp: int = 2
    """Tensor-parallel ranks (processes)."""
    quick: bool = False
    """Tiny shapes and few repeats: checks the benchmark runs, its numbers mean little."""
    sections: tuple[str, ...] = SECTIONS
    """Which measurements to run."""
    runtime: ModelShape = TINY
    """The model timed step by step (and whose collectives are counted)."""
    memory: ModelShape = TINY
    """The model whose per-rank bytes are measured (GPT-2 small in the full run)."""
    prep: ModelShape = TINY
    """The width used for preparation time; ``prep_layers`` sets its depths."""
    prep_layers: tuple[int, ...] = (6, 12)
    """Depths at which preparation is timed."""
    repeats: int = 3
    """Timed steps per variant (runtime) or preparations per depth (prep)."""
    warmup: int = 1
    """Untimed steps per variant before timing."""
    prep_repeats: int = 1
    """Preparations timed per depth."""
    threads_per_rank: int = 1
    """torch intra-op threads of each rank (CPU): tp ranks on tp cores."""
    single_threads: tuple[int, ...] = (1, 2)
    """Thread counts the single-process baseline is timed with (CPU); on GPU it runs once."""
    seed: int = 0
    """Seed of the model weights and the batch."""
    pp: int = 1
    """Pipeline stages of the memory section (its target is total / (tp * pp)); it measures tp only."""
    pp_runtime: ModelShape = TINY
    """The model timed at tp x pp=2 against the hand-written pipeline split (item 1)."""
    pp_microbatches: int = 2
    """Microbatches of that comparison (1F1B: at least the 2 stages)."""
    schedule_shape: ModelShape = TINY.with_(n_layer=4, batch=8)
    """The model timed with GPipe and 1F1B at tp=1, pp=2 (item 5)."""
    schedule_microbatches: tuple[int, ...] = (2, 4)
    """Microbatch counts of the schedule timings; each must divide ``schedule_shape.batch``."""
    imbalance: ModelShape = TINY.with_(n_layer=4)
    """The model whose planned stage imbalance is compared with an even split (GPT-2 small in the full run)."""
    imbalance_pp: tuple[int, ...] = (2, 4)
    """Stage counts of the imbalance comparison; each at most ``imbalance.n_layer``."""
    pp_repeats: int = 2
    """Timed rounds of the pipeline sections (after ``warmup``)."""

    def __post_init__(self):
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {self.device!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        unknown = set(self.sections) - set(SECTIONS)
        if unknown:
            raise ValueError(f"unknown sections {sorted(unknown)}; choose from {', '.join(SECTIONS)}")
        if self.tp < 2:
            raise ValueError(f"the benchmark compares tensor-parallel variants, so tp must be >= 2, got {self.tp}")
        if self.repeats < 1 or self.prep_repeats < 1 or self.pp_repeats < 1 or self.warmup < 0:
            raise ValueError("repeats, prep_repeats and pp_repeats must be >= 1 and warmup >= 0")
        self._check_pipeline()

    def _check_pipeline(self) -> None:
        if self.pp_microbatches < 2 or self.pp_runtime.batch % self.pp_microbatches:
            raise ValueError(f"pp_microbatches ({self.pp_microbatches}) must be >= 2 (1F1B over 2 stages) and divide "
                             f"the pp_runtime batch ({self.pp_runtime.batch})")
        bad = [m for m in self.schedule_microbatches if m < 1 or self.schedule_shape.batch % m]
        if bad:
            raise ValueError(f"schedule_microbatches {bad} must be >= 1 and divide the schedule batch "
                             f"({self.schedule_shape.batch})")
        if any(p < 2 or p > self.imbalance.n_layer for p in self.imbalance_pp):
            raise ValueError(f"imbalance_pp {self.imbalance_pp} must lie in 2..{self.imbalance.n_layer} (the blocks)")

    @property
    def torch_dtype(self) -> torch.dtype:
        """The torch dtype for ``dtype``."""
        return DTYPES[self.dtype]

    @property
    def label(self) -> str:
        """File stem of this run's results: ``cpu-fp32``, ``quick-cuda-bf16``."""
        return ("quick-" if self.quick else "") + f"{self.device}-{self.dtype}"

    def to_dict(self) -> dict:
        """JSON-ready settings, stored with the results."""
        return dataclasses.asdict(self)


def _full_shapes(device: str) -> dict:
    if device == "cuda":
        # On a GPU the real GPT-2 small step is the interesting one.
        step = GPT2_SMALL.with_(batch=8, seq=1024)
        return dict(runtime=step, memory=step, repeats=30, warmup=5, single_threads=(0,), pp_runtime=step,
                    pp_microbatches=4, schedule_shape=step, schedule_microbatches=(1, 2, 4, 8),
                    imbalance=GPT2_SMALL, pp_repeats=30)
    # A 2-core CPU: narrow enough that one tp=2 step takes ~0.1-0.3 s, with GPT-2's vocabulary split.
    runtime = ModelShape(n_layer=4, n_head=8, n_embd=256, vocab_size=8192, batch=4, seq=128)
    # Pipelines: batch 8, so 4 (tp x pp) or up to 8 (schedules) microbatches stay whole sequences; the
    # schedule model is deeper and has a smaller head, so 2 stages can be balanced (~0.3 s a step).
    return dict(runtime=runtime, memory=GPT2_SMALL, repeats=40, warmup=3,
                pp_runtime=runtime.with_(batch=8), pp_microbatches=4,
                schedule_shape=ModelShape(n_layer=8, n_head=8, n_embd=256, vocab_size=2048, batch=8, seq=64),
                schedule_microbatches=(1, 2, 4, 8), imbalance=GPT2_SMALL, pp_repeats=30)


def make_config(quick: bool, device: str = "cpu", dtype: str = "fp32", sections=SECTIONS,
                repeats: int | None = None, prep_layers: tuple[int, ...] | None = None) -> BenchConfig:
    """The preset for a full run or for ``--quick`` on ``device``; ``repeats`` overrides the timed steps,
    ``prep_layers`` the depths preparation is timed at."""
    if quick:
        preset = dict(runtime=TINY, memory=TINY, prep=TINY.with_(n_embd=64, n_head=4), prep_layers=(6, 12),
                      repeats=3, warmup=1, prep_repeats=1)
    else:
        preset = _full_shapes(device) | dict(prep=GPT2_SMALL.with_(batch=2, seq=64),
                                             prep_layers=(6, 12, 24, 48, 96), prep_repeats=3)
    if device == "cuda":
        preset["single_threads"] = (0,)
    if repeats is not None:
        preset["repeats"] = preset["pp_repeats"] = repeats
    if prep_layers is not None:
        preset["prep_layers"] = tuple(prep_layers)
    return BenchConfig(device=device, dtype=dtype, quick=quick, sections=tuple(sections), **preset)
