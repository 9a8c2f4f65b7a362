"""Capture: an unmodified nn.Module as a torch.fx graph, with its module and parameter names kept.

The first stage of autotp; ``torch_private`` holds every private torch API autotp relies on.
"""

from autotp.capture.export import Captured, capture, model_kwargs, normalise_inputs, tensor_aliases

__all__ = ["Captured", "capture", "model_kwargs", "normalise_inputs", "tensor_aliases"]
