"""Context parallelism with pipeline parallelism: every pipeline stage runs on its rank's chunks of the sequence.

Ranks lie on a (pp × dp × cp × tp) mesh (``runtime.mesh``). Each stage graph is rewritten as a whole rank graph is
(``rewrite.context_stages``): the hidden state a stage sends to the next is its rank's chunk already, so the
pipeline moves ``1/cp`` of the unsharded activations between stages, each stage exchanges keys and values over its
cp group, and the last stage gathers the model's outputs whole, so the loss is the unsharded one.
"""

from __future__ import annotations

from torch import fx

from autotp.planning.context_plan import plan_context
from autotp.planning.plan import Plan
from autotp.rewrite.comm import TorchComm
from autotp.rewrite.context_stages import apply_context_stage
from autotp.rewrite.stage_graphs import stage_boundaries
from autotp.runtime.mesh import Mesh
from autotp.runtime.pipeline import PipelineModule


class ContextPipelineModule(PipelineModule):
    """A ``PipelineModule`` whose stages run context-parallel: a gradient norm counts each gradient once (over
    the ranks of this rank's cp index), not once per cp rank holding a copy."""

    def _norm_group(self):
        return self.mesh.norm_group


def context_stages(stages: dict[bool, dict[int, fx.GraphModule]], graphs: dict, plan: Plan, mesh: Mesh,
                   options) -> None:
    """Rewrite this rank's stage graphs (mode -> stage index -> graph) in place to compute its chunks of every
    sequence, exchanging over ``mesh``'s cp group; ``graphs``: the captures they were split from."""
    comm = TorchComm(mesh.cp_group)
    last = len(plan.stages) - 1
    for mode, held in stages.items():
        layout = plan_context(graphs[mode], mesh.cp, options.cp_exchange, options.memory_budget)
        cuts = stage_boundaries(graphs[mode].analysis, plan).cuts
        for index, gm in held.items():
            apply_context_stage(gm, layout, comm, cuts[index - 1].value if index else None, index == last)
