"""autotp: automatic Megatron-style tensor parallelism for unmodified PyTorch transformers.

    pm = autotp.parallelize(model, tp=2, example_inputs=(input_ids,))
    plan = autotp.plan(model, tp=2, example_inputs=(input_ids,))
"""

from autotp.api import parallelize, plan
from autotp.errors import AutotpError, CaptureError, InputError, PassError, PlanError, RuntimeSetupError
from autotp.plan import Collective, Placement, PlacementKind, Plan, Region
from autotp.runtime import ParallelModule

__all__ = [
    "AutotpError", "CaptureError", "Collective", "InputError", "ParallelModule", "PassError", "Placement",
    "PlacementKind", "Plan", "PlanError", "Region", "RuntimeSetupError", "parallelize", "plan",
]
