"""Capture: an unmodified nn.Module as a torch.fx graph, with its module and parameter names kept.

The first stage of autotp, in subpackages by job: ``core`` (export, the captured value, example inputs, dynamic
sizes, failures), ``quirks`` (model quirks normalised), ``fallbacks`` (for models plain export cannot trace),
``speedups`` (and their switch, ``speedups_enabled``) and ``stamping`` (repeated blocks captured once).
``autotp.torch_private`` holds every private torch API and process-wide replacement the capture relies on.
"""

from autotp.torch_version import require_supported_torch

require_supported_torch()  # before any module that reads torch 2.13's internals: a clear error, not a deep one

from autotp.capture.core.captured import Captured  # noqa: E402 - after the check above, on purpose
from autotp.capture.core.examples import (  # noqa: E402
           ExampleInputs,
           Signature,
           example_inputs_of,
           name_inputs,
           synthesise,
           vocab_size,
)
from autotp.capture.core.export import capture, model_kwargs, tensor_aliases  # noqa: E402
from autotp.capture.speedups.speedup_switch import speedups_enabled  # noqa: E402
from autotp.capture.stamping.repeats import capture_repeated  # noqa: E402

__all__ = ["Captured", "ExampleInputs", "Signature", "capture", "capture_repeated", "example_inputs_of", "model_kwargs",
           "name_inputs", "speedups_enabled", "synthesise", "tensor_aliases", "vocab_size"]
