"""Capture: an unmodified nn.Module as a torch.fx graph, with its module and parameter names kept.

The first stage of autotp; ``inputs`` names, orders and synthesises the inputs a model is captured with;
``torch_private`` holds every private torch API autotp relies on.
"""

from autotp.capture.captured import Captured
from autotp.capture.examples import (
           ExampleInputs,
           Signature,
           example_inputs_of,
           name_inputs,
           synthesise,
           vocab_size,
)
from autotp.capture.export import capture, model_kwargs, tensor_aliases
from autotp.capture.repeats import capture_repeated

__all__ = ["Captured", "ExampleInputs", "Signature", "capture", "capture_repeated", "example_inputs_of", "model_kwargs", "name_inputs",
           "synthesise", "tensor_aliases", "vocab_size"]
