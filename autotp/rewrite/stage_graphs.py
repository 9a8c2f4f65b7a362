"""Split one rank's (tensor-parallel) graph into pipeline-stage GraphModules.

Stage boundaries come from the plan: stage i starts at its first module, i.e. at the last cut
candidate before that module's first parameter reader (the same rule as forced cuts). A stage takes
the hidden state from the previous stage plus the model's inputs, from which it recomputes the
values that depend only on inputs and buffers (masks, positions, RoPE tables); it returns its hidden
state and passes the inputs on, so every stage sees them. The last stage returns the model's outputs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import fx

from autotp.torch_private import is_guard_call
from autotp.errors import PlanError
from autotp.passes.analysis import Analysis
from autotp.passes.cuts import Cut, find_cuts, module_starts, unit_index
from autotp.passes.graph import frozen_activations, frozen_attrs, grad_nodes
from autotp.planning.plan import Plan
from autotp.rewrite.data_writes import stage_of_writes

HIDDEN = "autotp_hidden"


@dataclass(frozen=True)
class Boundaries:
    """The hidden-state value and graph position at the end of each stage but the last."""

    cuts: tuple[Cut, ...]


def stage_boundaries(analysis: Analysis, plan: Plan) -> Boundaries:
    """The cut ending each stage, re-derived from each next stage's first module."""
    cuts = find_cuts(analysis.graph, analysis.trainable, analysis.grad)
    starts = module_starts(analysis)
    chosen = []
    for stage in plan.stages[1:]:
        first = stage.modules[0] if stage.modules else None
        if first not in starts:
            raise PlanError(f"pipeline stage {stage.index} starts at {first!r}, which this model does not have "
                            "with parameters; re-plan for this model")
        unit = unit_index(cuts, starts[first])
        if unit == 0 or (chosen and cuts[unit - 1] == chosen[-1]):
            raise PlanError(f"pipeline stage {stage.index} starting at {first!r} would be empty; re-plan")
        chosen.append(cuts[unit - 1])
    return Boundaries(tuple(chosen))


def unit_of_nodes(gm: fx.GraphModule, original_position: dict[str, int], cuts: Sequence[Cut]) -> dict[str, int]:
    """The run between ``cuts`` (of the captured graph) each node of the rank graph ``gm`` lies in: a stage for a
    stage's cuts, a block for every cut; nodes the rewrite inserted go with their first reader."""
    unit: dict[str, int] = {}
    for node in reversed(list(gm.graph.nodes)):
        if node.name in original_position:
            unit[node.name] = sum(c.position < original_position[node.name] for c in cuts)
        else:
            unit[node.name] = min((unit[u.name] for u in node.users), default=len(cuts))
    return unit


class _StageBuilder:
    """Builds the graph of one stage by copying its nodes (and what they need) from the rank graph."""

    def __init__(self, gm: fx.GraphModule, stage_of: dict[str, int], grad: set[str], index: int, bounds: Boundaries,
                 frozen: set[str] = frozenset()):
        self.gm, self.stage_of, self.grad, self.index, self.frozen = gm, stage_of, grad, index, frozen
        self.incoming = bounds.cuts[index - 1].value if index > 0 else None
        self.outgoing = bounds.cuts[index].value if index < len(bounds.cuts) else None
        self.graph = fx.Graph()
        self.env: dict[str, fx.Node] = {}
        self.nodes = {n.name: n for n in gm.graph.nodes}

    def build(self) -> fx.Graph:
        nodes = list(self.gm.graph.nodes)
        inputs = [n for n in nodes if n.op == "placeholder"]
        if self.incoming is not None:
            hidden = self.graph.placeholder(HIDDEN)
            hidden.meta = dict(self.nodes[self.incoming].meta)
            self.env[self.incoming] = hidden
        for node in inputs:
            self.env[node.name] = self.graph.placeholder(node.name)
            self.env[node.name].meta = node.meta
        for node in nodes:
            if node.op in ("placeholder", "output") or self._skip(node):
                continue
            if self.stage_of[node.name] == self.index and node.name not in self.env:
                self._copy(node)
        self._output(nodes[-1], inputs)
        return self.graph

    def _skip(self, node: fx.Node) -> bool:
        # The export's input-shape guard module belongs to the whole model, not to a stage.
        return is_guard_call(node)

    def _copy(self, node: fx.Node) -> fx.Node:
        for dep in node.all_input_nodes:
            if dep.name not in self.env:
                self._bring(dep)
        self.env[node.name] = self.graph.node_copy(node, lambda n: self.env[n.name])
        return self.env[node.name]

    def _bring(self, node: fx.Node) -> None:
        """A value from another stage: parameters and input-only values are recomputed here."""
        if node.op == "get_attr" or (node.name not in self.grad and node.name not in self.frozen):
            self._copy(node)
            return
        why = " (computed from frozen parameters and the inputs)" if node.name in self.frozen else ""
        raise PlanError(f"stage {self.index} needs {node.name!r}{why} from another stage, but only the hidden state "
                        f"{self.incoming!r} crosses the boundary; re-plan this model, or pass cuts= at the start of "
                        "a layer")

    def _output(self, output: fx.Node, inputs: list[fx.Node]) -> None:
        if self.outgoing is None:
            flat = output.args[0]
            results = [self._lookup(v) for v in (flat if isinstance(flat, (list, tuple)) else [flat])]
            self.graph.output(tuple(results))
        else:
            self.graph.output((self._lookup_node(self.outgoing), *(self.env[n.name] for n in inputs)))

    def _lookup(self, value):
        return self._lookup_node(value.name) if isinstance(value, fx.Node) else value

    def _lookup_node(self, name: str) -> fx.Node:
        if name not in self.env:
            self._bring(self.nodes[name])
        return self.env[name]


def split_stages(gm: fx.GraphModule, analysis: Analysis, plan: Plan, indices: list[int]) -> list[fx.GraphModule]:
    """GraphModules for pipeline stages ``indices`` of this rank's graph ``gm``.

    Stage ``i > 0`` takes ``(hidden, *model_inputs)``; stages before the last return
    ``(hidden, *model_inputs)``; the last returns the model's flattened outputs.
    """
    bounds = stage_boundaries(analysis, plan)
    position = {n.name: i for i, n in enumerate(analysis.graph.nodes)}
    stage_of = stage_of_writes(gm, unit_of_nodes(gm, position, bounds.cuts))
    grad = grad_nodes(gm.graph, analysis.trainable)
    # Values of frozen work are activations too: a stage receives them or fails here, never recomputes them.
    frozen = frozen_activations(gm.graph, frozen_attrs(analysis.captured.module) - analysis.trainable, grad)
    out = []
    for index in indices:
        graph = _StageBuilder(gm, stage_of, grad, index, bounds, frozen).build()
        # Drop values assigned to this stage but read only by later ones; the purity check needs an
        # owning module, and rebuilding afterwards copies only the attributes still read.
        graph.owning_module = gm
        graph.eliminate_dead_code()
        graph.lint()
        out.append(fx.GraphModule(gm, graph, class_name=f"AutotpStage{index}"))
    return out
