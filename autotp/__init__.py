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

import importlib

from autotp.errors import (
    AutotpError,
    CaptureError,
    CheckpointError,
    InputError,
    InternalError,
    ModelPartError,
    PlanError,
    RankFailure,
    RuntimeSetupError,
    UnsupportedTorchError,
    UntestedTorchWarning,
)
from autotp.mixed_precision import MixedPrecision
from autotp.options import Options

_LAZY = {
    "parallelize": "autotp.api", "plan": "autotp.api", "CheckReport": "autotp.checker", "check": "autotp.checker",
    "Collective": "autotp.planning", "Placement": "autotp.planning", "PlacementKind": "autotp.planning",
    "Plan": "autotp.planning", "Region": "autotp.planning", "ParallelModule": "autotp.runtime",
    "PipelineModule": "autotp.runtime", "empty_weights": "autotp.runtime.meta_init",
    "parallelism_config": "autotp.runtime.integrations",
}
"""Names imported on first use: ``autotp --help`` and ``import autotp.errors`` must not pay for torch."""


def __getattr__(name: str):
    """The public name ``name``, imported from its module on first use (PEP 562)."""
    if name not in _LAZY:
        raise AttributeError(f"module 'autotp' has no attribute {name!r}")
    from autotp.torch_version import require_supported_torch

    require_supported_torch()
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value


__all__ = [
    "AutotpError", "CaptureError", "CheckReport", "CheckpointError", "Collective", "InputError", "InternalError", "ModelPartError",
    "MixedPrecision", "Options", "ParallelModule", "PipelineModule", "Placement", "PlacementKind", "Plan", "PlanError",
    "RankFailure", "Region", "RuntimeSetupError", "UnsupportedTorchError", "UntestedTorchWarning", "check",
    "empty_weights", "parallelism_config", "parallelize", "plan",
]
