"""The value capture returns: the exported graph plus the names that map it back to the original model.

The graph reads the model through a wrapper (``export._CaptureWrapper``) that holds it as its ``model``
attribute, so every parameter's ``get_attr`` target and every module path carries the ``model.`` prefix;
``Captured`` turns them back into the model's own names.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

from torch import fx

from autotp.capture.core.examples import Signature
from autotp.torch_private import output_spec
from autotp.passes.analysis import Analysis

WRAPPER_PREFIX = "model."
"""What the capture wrapper's ``model`` attribute puts before every name the graph holds."""


@dataclass
class Captured:
    """A captured model: the exported GraphModule plus the names that map it back to the original."""

    module: fx.GraphModule
    """The exported module; parameters live under ``model.<original name>``."""
    model_name: str
    """The class name of the captured model."""
    state_keys: tuple[str, ...]
    """Keys of the original ``model.state_dict()``, in order."""
    aliases: dict[str, str] = field(default_factory=dict)
    """Every parameter/buffer name of the model -> its first name, which the graph reads it by."""
    param_names: tuple[str, ...] = ()
    """Every parameter name of the model, tied ones under each of their names."""
    dim_names: dict[str, str] = field(default_factory=dict)
    """Symbol of each dynamic input size (``s72``) -> a readable name (``B``, ``T``)."""
    custom_functions: tuple[str, ...] = ()
    """User-defined autograd Functions the forward applies: the graph has their forward, not their backward."""
    example_sizes: dict[str, int] = field(default_factory=dict)
    """Symbol of each dynamic input size -> its value in the example inputs."""
    training: bool = True
    """Whether the graph is the model's train-mode graph (dropout applied) or its eval-mode one."""
    input_names: tuple[str, ...] = ()
    """The name of each graph input (the forward parameter it binds to), in placeholder order."""
    signature: Signature | None = None
    """What the model's forward accepts, to name the inputs of a later call."""
    assumptions: tuple[str, ...] = ()
    """Branches on tensor values taken as the example took them (the model's code and where it is); each is a
    runtime assertion in the graph, so an input that would take another branch raises."""

    @property
    def graph(self) -> fx.Graph:
        """The captured graph."""
        return self.module.graph

    @functools.cached_property
    def analysis(self) -> Analysis:
        """The passes' results for this capture, made once and shared by the planner, the rewriter of every rank,
        the checker and the runtime's input checks (the graph is never edited after capture)."""
        return Analysis(self)

    @property
    def out_spec(self):
        """The pytree spec that rebuilds the model's output from the graph's flat outputs."""
        return output_spec(self.module)

    @staticmethod
    def param_name(target: str) -> str:
        """The original parameter name of a ``get_attr`` target (static: modules that keep it keep no capture,
        whose graph holds the original model's tensors)."""
        return target[len(WRAPPER_PREFIX):] if target.startswith(WRAPPER_PREFIX) else target

    def attr_target(self, param_name: str) -> str:
        """The ``get_attr`` target of an original parameter name (inverse of ``param_name``)."""
        return WRAPPER_PREFIX + param_name

    def module_name(self, node: fx.Node) -> str:
        """The original module a node was traced in ('' for the top level)."""
        stack = node.meta.get("nn_module_stack") or {}
        if not stack:
            return ""
        path = list(stack.values())[-1][0]
        path = path if isinstance(path, str) else ""
        if path == "model":
            return ""
        return path[len(WRAPPER_PREFIX):] if path.startswith(WRAPPER_PREFIX) else path
