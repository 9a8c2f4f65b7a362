"""A rank's writes into its parameters' ``.data``, made through ``.data`` as the model makes them.

The capture records ``p.data.clamp_(...)`` as ``clamp_`` on the parameter under no grad (``capture.weight_writes``).
Written so, each write bumps the parameter's autograd version, and a stage of a pipeline, which runs the forward of
several microbatches before the backward of the first, then finds the weight its first backward saved changed
(by a write that changed no value: a clamp of clamped values). ``.data`` shares the parameter's storage but not
its version counter: the rank's graph writes through it, as the model does.

In a pipeline, a write runs in the stage that reads the parameter (``stage_of_writes``), wherever the forward made
it: a write in the model's top-level forward to a weight of a later layer would otherwise write stage 0's copy.
Under FSDP the graph writes the all-gathered weight, which is dropped after the forward; the runtime makes the
same writes on the stored shards first (``runtime.data_parallel``: an elementwise write of a shard is the shard of
the write), finding them through ``passes.parameter_data``.
"""

from __future__ import annotations

import torch
from torch import fx

from autotp.capture.quirks.weight_writes import parameter_writes
from autotp.errors import PlanError
from autotp.passes.parameter_data import data_of, data_writes


def write_through_data(gm: fx.GraphModule) -> int:
    """Make every in-place write to a parameter of ``gm`` write its ``.data``; returns how many were."""
    writes = parameter_writes(gm)
    for write, parameter in writes:
        with gm.graph.inserting_before(write):
            data = gm.graph.call_function(data_of, (parameter,))
        write.replace_input_with(parameter, data)
    if writes:
        gm.recompile()
    return len(writes)


def stage_of_writes(gm: fx.GraphModule, stage_of: dict[str, int]) -> dict[str, int]:
    """``stage_of`` (node name -> pipeline stage) with each write to a parameter in the stage of the parameter's
    readers, and its ``.data`` read with it. Raises PlanError where the readers are in several stages: each holds
    its own copy, and one stage's write would not reach the other's."""
    out = dict(stage_of)
    for write, parameter in data_writes(gm):
        stages = {stage_of[u.name] for u in parameter.users if u.target is not data_of}
        if len(stages) > 1:
            raise PlanError(f"parameter {parameter.target} is written in place by the forward ({write.target}) and "
                            f"read in pipeline stages {sorted(stages)}, which hold a copy each: one stage's write "
                            "would not reach the other's; choose stages that keep its readers together "
                            "(pp=1, or other stage cuts)")
        if stages:
            out[write.name] = out[write.args[0].name] = stages.pop()
    return out

