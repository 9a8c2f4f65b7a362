"""The rewriter: the only code that changes graphs. Builds one rank's GraphModule from a plan.

It copies the captured graph (never the user's model), slices every split parameter to this rank's
shard, changes the shape constants that count split features or heads, and inserts the collectives
that sharding propagation asked for, as modules calling Megatron's autograd operators.
"""

from __future__ import annotations

import copy
import warnings

import torch
from torch import fx, nn

from autotp.capture import Captured
from autotp.collectives import CopyToTP, GatherFromTP, ReduceFromTP, ScatterToTP, masked_embedding
from autotp.errors import InputError
from autotp.passes.graph import get_arg, with_arg
from autotp.passes.projections import Projection
from autotp.plan import Plan
from autotp.planner import Analysis
from autotp.shards import local_shard, segments_or_whole

aten = torch.ops.aten


def _copy_graph_module(source: fx.GraphModule) -> fx.GraphModule:
    """A new GraphModule over a copy of ``source``'s graph; its attributes still point at the source."""
    with warnings.catch_warnings():
        # torch's pytree deprecates LeafSpec isinstance checks that its own deepcopy still triggers.
        warnings.filterwarnings("ignore", category=FutureWarning)
        graph = copy.deepcopy(source.graph)  # copies nodes (shallow meta) and the pytree codegen
    return fx.GraphModule(source, graph, class_name="AutotpRankModule")


def _set_attr(gm: nn.Module, target: str, value: torch.Tensor) -> None:
    owner, _, name = target.rpartition(".")
    module = gm.get_submodule(owner) if owner else gm
    if isinstance(value, nn.Parameter):
        module.register_parameter(name, value)
    else:
        module.register_buffer(name, value)


def materialise(gm: fx.GraphModule, captured: Captured, plan: Plan, rank: int,
                made: dict[int, torch.Tensor] | None = None) -> None:
    """Give ``gm`` its own tensors: this rank's shard of split parameters, copies of the rest.

    Tied weights (one tensor under several names) get one new tensor, so they stay tied; pass the same
    ``made`` to several modules (pipeline stages on one rank) to share tensors between them too.
    """
    made = {} if made is None else made
    for target, param in list(gm.named_parameters(remove_duplicate=False)):
        if id(param) not in made:
            placement = plan.placements.get(captured.aliases.get(captured.param_name(target), ""))
            data = param.detach()
            if placement is not None and placement.is_split:
                segments = segments_or_whole(placement.segments, data.shape[placement.dim])
                data = local_shard(data, placement.dim, segments, rank, plan.tp)  # already a new tensor
            else:
                data = data.clone()
            made[id(param)] = nn.Parameter(data, requires_grad=param.requires_grad)
        _set_attr(gm, target, made[id(param)])
    for target, buf in list(gm.named_buffers(remove_duplicate=False)):
        made.setdefault(id(buf), buf.detach().clone())
        _set_attr(gm, target, made[id(buf)])


class _Surgeon:
    """Applies one propagation result to one rank's graph."""

    def __init__(self, gm: fx.GraphModule, analysis: Analysis, group, rank: int, tp: int):
        self.gm, self.graph = gm, gm.graph
        self.analysis, self.group, self.rank, self.tp = analysis, group, rank, tp
        self.nodes = {n.name: n for n in self.graph.nodes}
        self.count = 0

    def call_module(self, module: nn.Module, after: fx.Node, args: tuple) -> fx.Node:
        name = f"autotp_{type(module).__name__.lower()}_{self.count}"
        self.count += 1
        self.gm.add_submodule(name, module)
        with self.graph.inserting_after(after):
            return self.graph.call_module(name, args)

    def step_module(self, step) -> nn.Module:
        if step[0] == "copy":
            return CopyToTP(self.group)
        cls = GatherFromTP if step[0] == "gather" else ScatterToTP
        return cls(self.group, step[1].dim, step[1].segments)

    def convert(self, conv) -> None:
        value = self.nodes[conv.source]
        for step in conv.steps:
            value = self.call_module(self.step_module(step), value, (value,))
        for consumer, path in conv.consumers:
            if get_arg(self.nodes[consumer], path) is not self.nodes[conv.source]:
                raise InputError(f"internal: {consumer} no longer reads {conv.source}")
            with_arg(self.nodes[consumer], path, value)

    def reduce_after(self, node: fx.Node, bias: fx.Node | None) -> None:
        """Megatron's ``g`` after ``node``; a row-split layer's bias is added once, after the sum."""
        users = list(node.users)
        out = self.call_module(ReduceFromTP(self.group), node, (node,))
        if bias is not None:
            with self.graph.inserting_after(out):
                out = self.graph.call_function(aten.add.Tensor, (out, bias))
        for user in users:
            user.replace_input_with(node, out)

    def row(self, node: fx.Node, proj: Projection) -> None:
        bias = None
        if node.target is aten.addmm.default:
            bias = node.args[0]
            node.target, node.args = aten.mm.default, (node.args[1], node.args[2])
        elif proj.bias is not None:
            bias = node.args[2]
            node.args = node.args[:2]
        self.reduce_after(node, bias)

    def embedding(self, node: fx.Node, vocab_rows: int) -> None:
        local = vocab_rows // self.tp
        start = self.rank * local
        node.target = masked_embedding
        node.args = (node.args[0], node.args[1], start, start + local)
        self.reduce_after(node, None)

    def apply(self, prop) -> None:
        for name, path, value in prop.fixes:
            with_arg(self.nodes[name], path, value)
        for conv in prop.conversions.values():
            self.convert(conv)
        for name in prop.reduced:
            node = self.nodes[name]
            if name in self.analysis.embeddings:
                self.embedding(node, self.analysis.embeddings[name].num_embeddings)
            else:
                self.row(node, self.analysis.projections[name])
        self.graph.lint()
        self.gm.recompile()


def build_graph(captured: Captured, plan: Plan, rank: int, group, analysis: Analysis | None = None) -> fx.GraphModule:
    """This tensor-parallel rank's graph (fixed shapes, collectives); attributes still point at the model."""
    gm = _copy_graph_module(captured.module)
    if plan.tp > 1:
        analysis = analysis or Analysis(captured)
        by_target = {captured.attr_target(captured.aliases.get(name, name)): p for name, p in plan.placements.items()}
        _Surgeon(gm, analysis, group, rank, plan.tp).apply(analysis.propagate(by_target, plan.tp))
    return gm


def rewrite(captured: Captured, plan: Plan, rank: int, group) -> fx.GraphModule:
    """This rank's GraphModule for ``plan``: sharded parameters, fixed shapes, inserted collectives."""
    gm = build_graph(captured, plan, rank, group)
    materialise(gm, captured, plan, rank)
    return gm
