"""What a parallel module accepts: the inputs the model was captured with, checked before they run.

A wrong input inside the rank graph would surface as a raw torch error (or a failed export guard) in
the middle of a forward; here it becomes an ``InputError`` saying what was expected.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import fx

from autotp.errors import InputError


@dataclass(frozen=True)
class InputSpec:
    """The model inputs a rank graph takes: their names (as captured), dtypes and numbers of dims."""

    names: tuple[str, ...]
    dtypes: tuple[torch.dtype, ...]
    dims: tuple[int, ...]

    @classmethod
    def of(cls, graph: fx.Graph) -> InputSpec:
        """The spec of a captured graph's inputs."""
        values = [n.meta.get("val") for n in graph.find_nodes(op="placeholder")]
        return cls(tuple(n.name for n in graph.find_nodes(op="placeholder")),
                   tuple(v.dtype for v in values), tuple(v.dim() for v in values))

    def check(self, inputs: tuple, kwargs: dict) -> None:
        """Raise ``InputError`` naming the first input that does not fit."""
        if kwargs:
            raise InputError(f"pass the inputs positionally, in the order of example_inputs ({len(self.names)} "
                             f"tensor(s)); got keyword argument(s) {', '.join(sorted(kwargs))}")
        if len(inputs) != len(self.names):
            raise InputError(f"the model was captured with {len(self.names)} input tensor(s) but got {len(inputs)}; "
                             "pass the same inputs as example_inputs, in the same order")
        for i, (x, dtype, dims) in enumerate(zip(inputs, self.dtypes, self.dims)):
            if not isinstance(x, torch.Tensor):
                raise InputError(f"input {i} is a {type(x).__name__}, not a tensor")
            if x.is_floating_point() != dtype.is_floating_point or x.dim() != dims:
                raise InputError(f"input {i} is a {x.dim()}-d {x.dtype} tensor but the model was captured with a "
                                 f"{dims}-d {dtype} one (token ids are integers); pass inputs like example_inputs")
            if x.is_meta:
                raise InputError(f"input {i} is on the meta device (it has no values); pass real tensors")

    def run(self, module: fx.GraphModule, inputs: tuple, kwargs: dict):
        """``module(*inputs)`` after checking them; a failed capture guard becomes an ``InputError``."""
        self.check(inputs, kwargs)
        try:
            return module(*inputs)
        except AssertionError as e:
            if "Guard failed" not in str(e):
                raise
            guard = str(e).strip().splitlines()[0]
            raise InputError(f"these inputs' sizes are outside what the model was captured for ({guard}); the "
                             "capture keeps sizes dynamic only within the bounds the model's code allows (a "
                             "position table, a cached mask): use shorter inputs, or capture with example_inputs "
                             "of the longest size you will use") from e
