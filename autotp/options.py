"""Typed choices shared by the library, the CLI and the pictures (one definition each)."""

from __future__ import annotations

from enum import Enum


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


class DataParallelMode(str, Enum):
    """How data-parallel replicas hold the model."""

    FSDP = "fsdp"
    """Parameters, gradients and optimizer state sharded over the replicas (torch's FSDP2 ``fully_shard``)."""
    REPLICATE = "replicate"
    """Every replica holds the whole rank module; gradients are averaged by all-reduce (as DDP)."""


class VocabChoice(str, Enum):
    """Whether the token embedding and LM head are split along the vocabulary."""

    AUTO = "auto"
    """As the cost model finds faster, within the memory budget (``autotp.planning.choose``)."""
    SPLIT = "split"
    """Always (Megatron's choice)."""
    WHOLE = "whole"
    """Never: every rank holds both tables whole."""
