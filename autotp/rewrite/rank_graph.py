"""The tensor-parallel rewrite: one rank's GraphModule from a plan.

It copies the captured graph (never the user's model), slices every split parameter to this rank's
shard, changes the shape constants that count split features or heads, and inserts the collectives
that sharding propagation asked for, as modules calling Megatron's autograd operators.
"""

from __future__ import annotations

import operator

import torch
from torch import fx, nn

from autotp.capture import Captured
from autotp.errors import InternalError
from autotp.passes.analysis import Analysis
from autotp.passes.graph import ChunkOf, DividedBy, WritesWithin, arg_or_default, get_arg
from autotp.passes.placement import PlacementKind, Source, Want, chunk_span, own_tensors, part_of
from autotp.passes.projections import CONVOLUTIONS, Projection
from autotp.passes.propagation import Conversion, Propagation
from autotp.passes.steps import COPY, Operator, fused
from autotp.planning.plan import Plan
from autotp.rewrite.collectives import (
    GatherToRegion,
    OutputGather,
    collective_module,
    split_args,
)
from autotp.rewrite.columns import OverlappedColumnLinear, Regather, RegatheredAddmm, RegatheredLinear
from autotp.rewrite.comm import Communicator
from autotp.rewrite.data_writes import write_through_data
from autotp.rewrite.grad_bucket import GradSum
from autotp.rewrite.dtypes import drop_dtype_checks
from autotp.passes.embedding_adapters import joined_lookups, lookup_rows
from autotp.rewrite.joined_lookups import reduce_joined
from autotp.rewrite.joined_sums import JoinedReduction, reduce_with_riders
from autotp.passes.grouped_banks import expert_placements
from autotp.rewrite.expert_dispatch import dispatch_experts
from autotp.rewrite.loop_dispatch import dispatch_loops
from autotp.rewrite.graph_edit import (
    STANDS_FOR,
    copy_graph_module,
    set_tensor,
    with_arg,
)
from autotp.rewrite.index_writes import write_within
from autotp.rewrite.output_values import layout_copy, overwritable
from autotp.rewrite.random_draws import replace_random_ops
from autotp.rewrite.single_group import route_single_group
from autotp.rewrite.streams import RankStream
from autotp.rewrite.vocab_parallel import masked_embedding

aten = torch.ops.aten


def plan_ep(plan: Plan) -> int:
    """The expert-parallel ranks of ``plan`` (a plan without options split its experts over the tp ranks)."""
    return plan.options.ep if plan.options is not None else plan.tp


def _part(placement, shape: tuple[int, ...], plan: Plan, rank: int, expert_rank: int | None):
    """This rank's part of a tensor placed ``placement``: a bank split by experts among the ep ranks, else among tp."""
    if placement is not None and placement.kind is PlacementKind.EXPERT:
        return part_of(placement, shape, rank if expert_rank is None else expert_rank, plan_ep(plan))
    return part_of(placement, shape, rank, plan.tp)


def _wants(modules, plan: Plan, rank: int, made: dict[int, torch.Tensor],
           expert_rank: int | None = None) -> dict[int, Want]:
    """Every tensor of ``modules`` (pairs of a GraphModule and its capture) not yet in ``made``, by id."""
    wants: dict[int, Want] = {}
    for gm, captured in modules:
        params = dict(gm.named_parameters(remove_duplicate=False))
        for target, tensor in [*params.items(), *gm.named_buffers(remove_duplicate=False)]:
            if id(tensor) in made or id(tensor) in wants:
                continue
            name = captured.aliases.get(captured.param_name(target), captured.param_name(target))
            placement = plan.placements.get(name) if target in params else None  # buffers are never split
            wants[id(tensor)] = Want(name, tensor, _part(placement, tuple(tensor.shape), plan, rank, expert_rank))
    return wants


def materialise_all(modules, plan: Plan, rank: int, made: dict[int, torch.Tensor] | None = None,
                    source: Source | None = None, expert_rank: int | None = None) -> None:
    """Give every GraphModule of ``modules`` (pairs of a module and its capture) its own tensors: this rank's
    part of split parameters, copies of the rest, all asked of ``source`` at once (default: the model's own).

    Tied weights (one tensor under several names) get one new tensor, so they stay tied; the modules share
    tensors they both read (train and eval graphs, pipeline stages on one rank), as does a later call given the
    same ``made``. ``expert_rank``: this rank's place among the ep ranks (default: its tp rank, as at ep = tp).
    """
    made = {} if made is None else made
    wants = _wants(modules, plan, rank, made, expert_rank)
    for (key, want), data in zip(wants.items(), (source or own_tensors)(list(wants.values()))):
        if tuple(data.shape) != want.part.local_shape:
            raise InternalError(f"the tensor source gave {want.name} shape {list(data.shape)}, "
                                f"expected {list(want.part.local_shape)}")
        tensor = want.tensor
        made[key] = nn.Parameter(data, requires_grad=tensor.requires_grad) if isinstance(tensor, nn.Parameter) else data
    for gm, _ in modules:
        for target, tensor in [*gm.named_parameters(remove_duplicate=False), *gm.named_buffers(remove_duplicate=False)]:
            set_tensor(gm, target, made[id(tensor)])


def materialise(gm: fx.GraphModule, captured: Captured, plan: Plan, rank: int,
                made: dict[int, torch.Tensor] | None = None, source: Source | None = None) -> None:
    """``materialise_all`` for one module."""
    materialise_all([(gm, captured)], plan, rank, made, source)


def _output_module(operator: Operator, comm: Communicator, shard) -> nn.Module:
    """The module making a split model output whole: a gather the runtime may defer."""
    if operator is not Operator.GATHER:
        raise InternalError(f"a model output needs {operator.value}, expected a gather")
    return OutputGather(comm, *split_args(shard))


def _matmul_by_transposed(node: fx.Node) -> bool:
    """``x @ W.t()``: a linear without a bias, written out."""
    if node.op != "call_function" or node.target is not aten.matmul.default or len(node.args) != 2 or node.kwargs:
        return False
    right = node.args[1]
    return isinstance(right, fx.Node) and right.op == "call_function" and right.target is aten.t.default


class _Surgeon:
    """Applies one propagation result to one rank's graph."""

    def __init__(self, gm: fx.GraphModule, analysis: Analysis, comm: Communicator, rank: int, tp: int):
        self.gm, self.graph = gm, gm.graph
        self.analysis, self.comm, self.rank, self.tp = analysis, comm, rank, tp
        self.nodes = {n.name: n for n in self.graph.nodes}
        self.count = 0

    def add(self, module: nn.Module) -> str:
        """Add ``module`` to the rank's GraphModule under a new name."""
        name = f"autotp_{type(module).__name__.lower()}_{self.count}"
        self.count += 1
        self.gm.add_submodule(name, module)
        return name

    def call_module(self, module: nn.Module, after: fx.Node, args: tuple) -> fx.Node:
        with self.graph.inserting_after(after):
            return self.graph.call_module(self.add(module), args)

    def convert(self, conv: Conversion) -> None:
        inside, outputs = conv.by_reader(self.graph.output_node().name)
        if inside and fused(conv.steps) == (COPY,) and len(inside) == 1 and self.overlap(inside[0]):
            return
        if inside:
            self.insert_steps(conv.source, conv.steps, inside, collective_module)
        if outputs:  # a model output's own gather, which a training step may defer
            self.insert_steps(self.uncopied(conv.source, outputs), conv.steps, outputs, _output_module)

    def uncopied(self, source: str, outputs) -> str:
        """The value a split model output copies (``logits.transpose(0, 1).contiguous()``), read by the output's
        gather instead: the gather makes a new whole tensor anyway, and a training step that defers it computes
        the loss on the shards without a B×T×V/tp copy forward and another backward."""
        node = self.nodes[source]
        if not layout_copy(node) or set(node.users) != {self.graph.output_node()}:
            return source
        copied = node.args[0]
        for consumer, path in outputs:
            with_arg(self.nodes[consumer], path, copied)
        self.graph.erase_node(node)
        return copied.name

    def insert_steps(self, source: str, steps, consumers, module_of) -> None:
        value = self.nodes[source]
        for step in fused(steps):
            module = module_of(step.operator, self.comm, step.shard)
            if isinstance(module, GradSum):  # its bucket sums the shares in one order on every rank: by name
                module.key = source
                module.bucket.expected.add(source)
            value = self.call_module(module, value, (value,))
        for consumer, path in consumers:
            if get_arg(self.nodes[consumer], path) is not self.nodes[source]:
                raise InternalError(f"node {consumer} no longer reads {source} at argument {path}")
            with_arg(self.nodes[consumer], path, value)
        if value.op == "call_module" and isinstance(self.gm.get_submodule(value.target), GatherToRegion):
            self.regather(value, [self.nodes[c] for c, path in consumers if path == (0,)])
        if value.op == "call_module" and isinstance(self.gm.get_submodule(value.target), GradSum):
            # read where it is used, not at the top: autograd runs the later-made nodes first, so the share then
            # arrives with its layer's backward, in time to join the layer's own all-reduce (``grad_bucket``)
            first = next((n for n in self.graph.nodes if n in value.users), None)
            if first is not None:
                first.prepend(value)

    def _linear(self, node: fx.Node) -> bool:
        """A projection as ``nn.Linear`` runs it (``aten.linear`` with its operands by position)."""
        return (node.op == "call_function" and node.target is aten.linear.default and not node.kwargs
                and node.name in self.analysis.projections)

    def overlap(self, reader: tuple[str, tuple]) -> bool:
        """Fuse ``f`` into the one projection reading its value (``OverlappedColumnLinear``), if it is one: a
        linear, or ``x @ W.t()`` (megatron-core's own layers, traced)."""
        node, path = self.nodes[reader[0]], reader[1]
        if path != (0,):
            return False
        if self._linear(node):
            args = node.args
        elif _matmul_by_transposed(node) and node.name in self.analysis.projections:
            args = (node.args[0], node.args[1].args[0])
        else:
            return False
        node.op, node.target, node.args = "call_module", self.add(OverlappedColumnLinear(self.comm)), args
        return True

    def _flattened_addmm(self, node: fx.Node) -> fx.Node | None:
        """The projection ``addmm(bias, x.view(-1, C), W)`` when ``node`` is that flattening view read by it alone
        (GPT-2's ``Conv1D``), else None."""
        if node.op != "call_function" or node.target not in (aten.view.default, aten.reshape.default) or \
                len(node.users) != 1 or len(node.args[1]) != 2 or node.args[1][0] != -1:
            return None
        source = node.args[0].args[0] if node.args[0].op == "call_module" else None  # the gather's input
        val = source.meta.get("val") if isinstance(source, fx.Node) else None
        if val is None or node.args[1][1] != val.shape[-1]:
            return None  # not [B*T, C] of its [B, T, C]: the layer could not run on the unflattened value
        user = next(iter(node.users))
        if user.target is aten.addmm.default and len(user.args) == 3 and user.args[1] is node and not user.kwargs \
                and user.name in self.analysis.projections:
            return user
        return None

    def regather(self, gathered: fx.Node, readers: list[fx.Node]) -> None:
        """Column projections reading ``gathered`` (``nn.Linear``'s op, or ``addmm`` of its flattening view) save
        its shard, not it, for backward."""
        position = {n: i for i, n in enumerate(self.graph.nodes)}
        takers = sorted((n for n in readers if self._linear(n) or self._flattened_addmm(n)), key=position.get)
        shared = Regather(self.gm.get_submodule(gathered.target))
        for i, node in enumerate(takers):
            linear = RegatheredLinear(shared, first=i == 0)
            addmm = self._flattened_addmm(node)
            if addmm is None:
                node.op, node.target = "call_module", self.add(linear)
                node.args = (gathered, gathered.args[0], *node.args[1:])
                continue
            addmm.op, addmm.target = "call_module", self.add(RegatheredAddmm(linear))
            addmm.args = (gathered, gathered.args[0], addmm.args[0], addmm.args[2])
            self.graph.erase_node(node)

    def replace(self, node: fx.Node, module: nn.Module) -> None:
        """Run ``module`` in place of ``node``'s op, on the same arguments (a parallel version of the op)."""
        node.op, node.target = "call_module", self.add(module)

    def reduce_after(self, node: fx.Node, operator: Operator, bias: fx.Node | None, shard=None) -> None:
        """The reduction after ``node`` (Megatron's ``g``, or a reduce-scatter onto ``shard``); a row-split layer's
        bias is added once, after it."""
        users = list(node.users)
        out = self.call_module(collective_module(operator, self.comm, shard), node, (node,))
        if bias is not None:
            with self.graph.inserting_after(out):
                out = self.graph.call_function(aten.add.Tensor, (out, bias))
        out.meta[STANDS_FOR] = node.name
        for user in users:
            user.replace_input_with(node, out)

    def reduce_joined(self, node: fx.Node, riders: list[fx.Node], shard) -> None:
        """The reduction after ``node`` (an all-reduce, or a reduce-scatter onto ``shard``) carrying ``riders``' sums
        (``rewrite.joined_sums``)."""
        reduce_with_riders(node, riders, JoinedReduction(self.comm, split_args(shard) if shard else None), self.add)

    def row(self, node: fx.Node, proj: Projection, reduction: Operator, shard) -> None:
        bias = None
        if node.target is aten.addmm.default:
            bias = node.args[0]
            node.target, node.args = aten.mm.default, (node.args[1], node.args[2])
        elif proj.bias is not None and proj.spatial:
            # a convolution keeps its later arguments (stride, padding); its bias, per channel, is added across
            # the spatial dims after the reduction
            bias = node.args[2]
            node.args = (*node.args[:2], None, *node.args[3:])
            with self.graph.inserting_before(node):
                bias = self.graph.call_function(aten.view.default, (bias, [-1] + [1] * proj.spatial))
        elif proj.bias is not None:
            bias = node.args[2]
            node.args = node.args[:2]
        self.reduce_after(node, reduction, bias, shard)

    def embedding(self, node: fx.Node, vocab_rows: int, reduction: Operator, shard, adapters=()) -> None:
        """A masked lookup of this rank's rows, all-reduced (with its ``adapters``' lookups:
        ``rewrite.joined_lookups``)."""
        for lookup in (node, *adapters):
            start, local = chunk_span(vocab_rows, self.tp, self.rank)  # this rank's rows, as the table was cut
            padding_idx = arg_or_default(lookup, 2, "padding_idx", -1)  # the planner refused the other options
            lookup.target = masked_embedding
            lookup.args, lookup.kwargs = (lookup.args[0], lookup.args[1], start, start + local, padding_idx), {}
        if adapters:
            reduce_joined(node, list(adapters), self.analysis, collective_module(reduction, self.comm, shard), self.add)
        else:
            self.reduce_after(node, reduction, None, shard)

    def apply(self, prop: Propagation) -> None:
        for name, path, value in prop.fixes:
            node = self.nodes[name]
            if isinstance(value, DividedBy):  # a size the graph computes (``B * H``): divide it where it is read
                with self.graph.inserting_before(node):
                    value = self.graph.call_function(operator.floordiv, (get_arg(node, path), value.by))
            elif isinstance(value, ChunkOf):  # a vocabulary cut unevenly: this rank's chunk of it
                value = chunk_span(value.size, value.chunks, self.rank // (self.tp // value.chunks))[1]
            elif isinstance(value, WritesWithin):  # writes at indices of the split dim: this rank's
                write_within(node, value, self.rank, self.tp)
                continue
            with_arg(node, path, value)
            if node.target in CONVOLUTIONS and path == (CONVOLUTIONS[node.target],) and value == 1:
                route_single_group(node)  # one group per rank: a dense convolution (``single_group``)
        for conv in prop.conversions.values():
            self.convert(conv)
        joined = joined_lookups(self.analysis, prop)
        partners = {lookup for lookups in joined.values() for lookup in lookups}
        partners |= {rider for riders in prop.riders.values() for rider in riders}  # reduced with their carrier's
        for name, reduction in prop.reduced.items():
            node, shard = self.nodes[name], prop.layouts.get(name)  # a shard: reduce-scattered onto it
            if name in prop.riders:
                self.reduce_joined(node, [self.nodes[r] for r in prop.riders[name]], shard)
                continue
            if name in partners:
                continue  # an adapter's lookup, reduced with its base lookup's
            rows = lookup_rows(self.analysis, name)
            if rows is not None and reduction in (Operator.VOCAB_EMBEDDING, Operator.REDUCE_SCATTER):
                self.embedding(node, rows, reduction, shard, [self.nodes[n] for n in joined.get(name, ())])
            elif reduction is Operator.CROSS_ENTROPY:  # told the logits' split, to find this rank's classes
                self.replace(node, collective_module(reduction, self.comm, prop.layouts[node.args[0].name]))
            elif reduction is Operator.RUNNING_STATS:
                self.replace(node, collective_module(reduction, self.comm, shard))
            elif name in self.analysis.projections:
                self.row(node, self.analysis.projections[name], reduction, shard)
            else:  # a sum or mean over a split dim, a parameter chunk several ranks hold
                self.reduce_after(node, reduction, None, shard)
        for node in self.graph.nodes:
            if node.op == "call_module" and isinstance(self.gm.get_submodule(node.target), OutputGather):
                self.gm.get_submodule(node.target).overwritable = overwritable(node, self.gm)
        self.graph.lint()
        self.gm.recompile()


def build_graph(captured: Captured, plan: Plan, rank: int, comm: Communicator | None,
                stream: RankStream | None = None, inputs=None, ep_comm: Communicator | None = None) -> fx.GraphModule:
    """This tensor-parallel rank's graph (fixed shapes, collectives over ``comm``, random ops drawing from
    ``stream``); its attributes still point at the model's tensors. ``inputs`` (placeholder name -> Shard): inputs
    the rank is given split (a KV cache). ``ep_comm``: the expert-parallel group (default: ``comm``, as at ep = tp)."""
    gm = copy_graph_module(captured.module)
    # autocast and pm.to(dtype) change the captured dtypes on purpose (``rewrite.dtypes``)
    checks_dropped = drop_dtype_checks(gm)
    layouts = {}
    if plan.tp > 1:
        analysis = captured.analysis
        prop = analysis.propagate_placements(plan.placements, plan.tp, plan.sequence_parallel, inputs)
        _Surgeon(gm, analysis, comm, rank, plan.tp).apply(prop)
        layouts = prop.layouts
    experts = expert_placements(captured, plan)
    if experts:
        dispatch_experts(gm, experts, ep_comm or comm, comm if plan.tp > 1 else None)
        dispatch_loops(gm, experts, ep_comm or comm, comm if plan.tp > 1 else None)
    if stream is not None:
        replace_random_ops(gm, layouts, stream, rank, plan.tp)
    write_through_data(gm)
    if checks_dropped:
        gm.recompile()
    return gm


def rewrite(captured: Captured, plan: Plan, rank: int, comm: Communicator | None, stream: RankStream | None = None,
            made: dict | None = None, source: Source | None = None) -> fx.GraphModule:
    """This rank's GraphModule for ``plan``: sharded parameters, fixed shapes, inserted collectives."""
    gm = build_graph(captured, plan, rank, comm, stream=stream)
    materialise(gm, captured, plan, rank, made, source)
    return gm
