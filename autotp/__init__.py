"""autotp: automatic Megatron-style tensor parallelism for unmodified PyTorch transformers.

    pm = autotp.parallelize(model, tp=2, example_inputs=(input_ids,))
    plan = autotp.plan(model, tp=2, example_inputs=(input_ids,))

The package is laid out as the stages data flows through: ``capture`` → ``passes`` (installed from
the top-level ``passes/`` folder) → ``planning`` → ``rewrite`` → ``runtime``, with ``api`` joining
them and ``tools`` (CLI, model building, report, exports, pictures) reading plans.
"""

from autotp.api import parallelize, plan
from autotp.errors import AutotpError, CaptureError, InputError, InternalError, PlanError, RuntimeSetupError
from autotp.planning import Collective, Placement, PlacementKind, Plan, Region
from autotp.runtime import ParallelModule

__all__ = [
    "AutotpError", "CaptureError", "Collective", "InputError", "InternalError", "ParallelModule", "Placement",
    "PlacementKind", "Plan", "PlanError", "Region", "RuntimeSetupError", "parallelize", "plan",
]
