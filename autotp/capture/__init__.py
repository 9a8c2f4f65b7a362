"""Capture: an unmodified nn.Module as a torch.fx graph, with its module and parameter names kept.

The first stage of autotp; ``inputs`` names, orders and synthesises the inputs a model is captured with;
``torch_private`` holds every private torch API autotp relies on.
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
from autotp.capture.stamping.repeats import capture_repeated  # noqa: E402

__all__ = ["Captured", "ExampleInputs", "Signature", "capture", "capture_repeated", "example_inputs_of", "model_kwargs", "name_inputs",
           "synthesise", "tensor_aliases", "vocab_size"]
