"""autotp: automatic Megatron-style tensor parallelism for unmodified PyTorch transformers.

    pm = autotp.parallelize(model, tp=2, example_inputs=(input_ids,))
    pm = autotp.parallelize(model, tp=2, example_inputs={"input_ids": ids, "attention_mask": mask, "labels": ids})
    pm = autotp.parallelize(model, tp=2, pp=2)          # token ids synthesised from the vocabulary
    plan = autotp.plan(model, tp=2, example_inputs=(input_ids,))
    print(autotp.check(model, tp=2, example_inputs=(input_ids,)))   # every rank simulated in this process

The package is laid out as the stages data flows through: ``capture`` → ``passes`` (installed from
the top-level ``passes/`` folder) → ``planning`` → ``rewrite`` → ``runtime``, with ``api`` joining
them and ``tools`` (CLI, model building, report, exports, pictures) reading plans.
"""

from autotp.api import parallelize, plan
from autotp.checker import CheckReport, check
from autotp.errors import (
    AutotpError,
    CaptureError,
    CheckpointError,
    InputError,
    InternalError,
    PlanError,
    RankFailure,
    RuntimeSetupError,
)
from autotp.options import Options
from autotp.planning import Collective, Placement, PlacementKind, Plan, Region
from autotp.runtime import ParallelModule, PipelineModule
from autotp.runtime.readers import empty_weights

__all__ = [
    "AutotpError", "CaptureError", "CheckReport", "CheckpointError", "Collective", "InputError", "InternalError",
    "Options", "ParallelModule", "PipelineModule", "Placement", "PlacementKind", "Plan", "PlanError", "RankFailure",
    "Region", "RuntimeSetupError", "check", "empty_weights", "parallelize", "plan",
]
