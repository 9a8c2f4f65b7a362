"""Sharding propagation: from per-parameter placements to the layout of every value in the graph.

This is a read-only analysis. It walks the graph once in order, applies each op's rule
(``rules.py``), and records what a rewrite must do for the result to equal the unsharded model:
the conversions on edges (Megatron's ``f``, gathers, slices), the reductions after row-split
projections and vocabulary-split embeddings (Megatron's ``g``), the shape constants to change, and
every size that must divide by tp. Projections and embeddings take their role from the placement of
their weight, so the same code checks a candidate plan and drives the final rewrite.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
import heapq
from dataclasses import dataclass

import sympy
import torch
from autotp.passes.graph import (
    ArgPath,
    chunk_size,
    grad_nodes,
    mutated_args,
    rank,
    sizes,
    tensor_args,
)
from autotp.passes.adapter_sequence import carry_sequence_sums
from autotp.passes.sequence_flat import gather_into_flat_regions, reduce_when_unflattened, unflattened
from autotp.passes.partial import carry_partial_sums
from autotp.passes.dora_norms import join_dora_norms
from autotp.passes.placement import Layout, PlacementKind, Shard
from autotp.passes.embedding_adapters import split_rows_lookup
from autotp.passes.expert_banks import one_expert
from autotp.passes.graph_index import GraphIndex
from autotp.passes.projections import Embedding, Projection, segment_of
from autotp.passes.propagation import Conversion, Propagation, Violation
from autotp.passes.reshapes import static
from autotp.passes.rule_kit import size_checks
from autotp.passes.rules import (
    BLOCK_AWARE,
    REPLICA_AWARE,
    SPREAD_AWARE,
    Context,
    Decision,
    replicate_all,
    rule_for,
)
from autotp.passes.steps import COPY, Operator, steps_between
from torch import fx

aten = torch.ops.aten


@dataclass(frozen=True)
class Role:
    """What a projection does under the plan: column-split (with fused ``segments``) or row-split."""

    kind: PlacementKind
    segments: tuple[int, ...] = ()
    replicas: int = 1


def _fused(segments: tuple[int, ...]) -> tuple[int, ...]:
    """A row's input segments when it has several (parts concatenated side by side, each split on its own:
    attention's heads beside an MLP's channels, as a single-stream block concatenates them), else ()."""
    return segments if len(segments) > 1 else ()


def _row_input(layout: Layout, features: int, in_features: int) -> bool:
    """Whether a projection's input arrives split along its input features, plainly or in segments (or in chunks
    several ranks hold, which each narrows to its plain part for free: ``steps.narrow``)."""
    return (isinstance(layout, Shard) and layout.dim == features and layout.size == in_features
            and layout.blocks == 1 and not layout.spread)


def _narrowed(ins: dict, tp: int) -> dict | None:
    """The plain splits of the inputs whose chunks several ranks hold (each rank's part of its chunk, which
    ``steps.narrow`` keeps for free), for a rule that knows no such chunks; None where one cannot be narrowed
    (folded in blocks, or a segment tp does not divide)."""
    out = {}
    for path, (_, lay) in ins.items():
        if isinstance(lay, Shard) and lay.replicas != 1:
            if lay.blocks != 1 or any(static(s) is None or s % tp for s in lay.segments):
                return None
            out[path] = dataclasses.replace(lay, replicas=1)
    return out


def _finer(a: tuple[int, ...] | None, b: tuple[int, ...]) -> tuple[int, ...]:
    """Segments cut at the boundaries of both ``a`` and ``b`` (two slices of one fused output: Q, then K)."""
    if a is None or sum(a) != sum(b):
        return b
    cuts = sorted({sum(a[:i]) for i in range(len(a) + 1)} | {sum(b[:i]) for i in range(len(b) + 1)})
    return tuple(y - x for x, y in zip(cuts, cuts[1:]))


class _Walker:
    """One propagation run (state for the walk; the result is ``self.result``)."""

    def __init__(self, graph, projections, embeddings, param_layouts, tp, grad, auto_rows, index, sequence,
                 inputs=None, decisions=None):
        self.graph = graph
        self.decisions = decisions
        self.inputs = inputs or {}
        self.sequence = sequence
        self.projections = projections
        self.embeddings = embeddings
        self.param_layouts = param_layouts
        self.auto_rows = auto_rows
        self.ctx = Context(tp=tp, grad=grad)
        self.result = Propagation(tp=tp)
        self.index = index
        self.flat: set[str] = set()
        """Reshapes where a row layer computed on flattened tokens reduce-scatters (``sequence_flat``)."""

    @property
    def nodes(self) -> dict[str, fx.Node]:
        return self.index.nodes

    def run(self, windowed: bool, stop=None) -> Propagation:
        """Walk the graph; ``windowed`` visits, in graph order, only the split parameters' readers and the readers
        of split values (enough when looking for one region: a node that reads only whole values computes a whole
        value and adds nothing, so a search costs what its split reaches, not the graph's size). ``stop(node,
        result)``, asked after each node of a windowed walk, ends it early (the result is then unfinished)."""
        order = self.index.order
        if not windowed:
            for node in order:
                self.visit(node)
            return self.result
        positions = self.index.positions
        pending = sorted({p for t in self.param_layouts for p in self.index.readers.get(t, ())})
        queued = set(pending)
        while pending:
            node = order[heapq.heappop(pending)]
            self.visit(node)
            if stop is not None and stop(node, self.result):
                break
            if self._split(node):
                for user in node.users:
                    if positions[user] not in queued:
                        queued.add(positions[user])
                        heapq.heappush(pending, positions[user])
        return self.result

    def _split(self, node: fx.Node) -> bool:
        """Whether ``node``'s value (or a part of it) came out split."""
        lay = self.result.layouts.get(node.name)
        return isinstance(lay, Shard) or (isinstance(lay, tuple) and any(isinstance(x, Shard) for x in lay))

    def layout(self, node: fx.Node) -> Layout:
        if node.op == "get_attr":
            return self.param_layouts.get(node.target)
        return self.result.layouts.get(node.name)

    def visit(self, node: fx.Node) -> None:
        res = self.result
        if node.op == "get_attr":
            lay = res.layouts[node.name] = self.param_layouts.get(node.target)
            if isinstance(lay, Shard) and lay.replicas != 1 and node.name in self.ctx.grad:
                res.reduced[node.name] = Operator.SHARED_GRAD  # each holder's gradient is a share
            return
        if node.op == "placeholder":
            res.layouts[node.name] = self.inputs.get(node.name)  # state passed in split (a KV cache), else whole
            return
        ins = {p: (n, self.layout(n)) for p, n, tensor in self.index.args(node)
               if tensor or isinstance(self.layout(n), tuple)}
        if node.op == "output":
            decision = Decision(None, wants={p: None for p in ins})
        else:
            decision = self.decide(node, ins)
        written = mutated_args(node)
        for path, want in decision.wants.items():
            if path in written and steps_between(ins[path][1], want):
                res.refusals.append((node.name, f"{node.target} writes in place to a value split across ranks"))
            if not self.split_broadcast(ins[path][0], ins[path][1], want):
                self.convert(node, path, ins[path][0], ins[path][1], want)
        res.layouts[node.name] = decision.out
        if decision.reduce is not None:
            res.reduced[node.name] = decision.reduce
        res.fixes.extend((node.name, p, v) for p, v in decision.fixes.items())
        found = [res.origins[n.name] for n, lay in ins.values()
                 if isinstance(lay, (Shard, tuple)) and n.name in res.origins]
        origins = found[0] if len(found) == 1 else frozenset().union(*found)
        if node.name in self.projections and isinstance(decision.out, Shard):
            origins = frozenset({node.name})
        if res.reduced.get(node.name) is Operator.REDUCE_SCATTER:
            origins = frozenset()  # a split along the sequence starts here; no column projection made it
        if origins and decision.out is not None:
            res.origins[node.name] = origins
        for size, what in decision.checks:
            if static(size) is None:
                continue  # a split of the sequence: its size is checked when an input arrives
            res.checked.append(size)
            if size % self.ctx.tp:
                res.violations.append(Violation(node.name, size, what, origins))
        if decision.hint is not None and origins:
            res.hints[origins] = _finer(res.hints.get(origins), decision.hint)

    def decide(self, node: fx.Node, ins: dict) -> Decision:
        if node.name in self.flat:  # a flattened row layer's partial sum, back in a shape with the sequence
            return Decision(self.sequence_shard(node), reduce=Operator.REDUCE_SCATTER)
        proj = self.projections.get(node.name)
        if proj is not None:
            role = self.role_of(proj, ins)
            if role is not None:
                return self.projected(node, proj, role)
        emb = self.embeddings.get(node.name)
        table = self.param_layouts.get(emb.weight) if emb is not None else None
        if isinstance(table, Shard) and table.dim == 1:  # a per-head table (relative position bias)
            return Decision(Shard(rank(node) - 1, table.segments), wants={(1,): None})
        if emb is not None and table is None and self.sequence:
            lookup = self.sequence_lookup(node, emb)
            if lookup is not None:
                return lookup
        if emb is None and node.target is aten.embedding.default and split_rows_lookup(self.layout(node.args[0])):
            table = self.layout(node.args[0])  # a computed table split by rows (``embedding_adapters``)
        if isinstance(table, Shard):
            out = self.sequence_shard(node)
            self.result.reduced[node.name] = Operator.REDUCE_SCATTER if out else Operator.VOCAB_EMBEDDING
            return Decision(out, wants={(1,): None},
                            checks=[(emb.num_embeddings if emb else table.size, "vocabulary size")])
        if self.decisions is None:
            return self.ruled(node, ins)
        key = (node, tuple((path, lay) for path, (_, lay) in ins.items()))
        if key not in self.decisions:
            self.decisions[key] = self.ruled(node, ins)
        return self.decisions[key]

    def ruled(self, node: fx.Node, ins: dict) -> Decision:
        """The decision of ``node``'s rule (or the safe rule, where it cannot apply) for its inputs' layouts."""
        rule = rule_for(node.target)
        shards = [lay for _, lay in ins.values() if isinstance(lay, Shard)]
        if rule not in BLOCK_AWARE and any(lay.blocks != 1 for lay in shards):
            rule = replicate_all  # a rule outside BLOCK_AWARE would drop the blocks of a folded split
        narrowed = {}
        if rule not in SPREAD_AWARE and any(lay.spread for lay in shards):
            rule = replicate_all  # likewise for chunks several ranks hold, spread over them
        elif rule not in REPLICA_AWARE and any(lay.replicas != 1 for lay in shards):
            narrowed = _narrowed(ins, self.ctx.tp)
            if narrowed is None:
                rule, narrowed = replicate_all, {}  # likewise for chunks several ranks hold
            else:
                ins = {p: (n, narrowed.get(p, lay)) for p, (n, lay) in ins.items()}
        try:
            decision = rule(node, ins, self.ctx)
        except TypeError:
            # Rules reason about splits of static sizes; one that cannot compare the dynamic size of a sequence
            # split (sympy refuses the truth value) takes the safe rule. Anything else is a bug in the rule.
            if not any(isinstance(lay, Shard) and static(lay.size) is None for _, lay in ins.values()):
                raise
            return replicate_all(node, ins, self.ctx)
        outs = decision.out if isinstance(decision.out, tuple) else (decision.out,)
        if any(isinstance(o, Shard) and len(o.segments) > 1 and static(o.size) is None for o in outs):
            # Sequence shards side by side (a cat along the sequence): each rank's chunk of every part has a size
            # known only at run time, which no collective could find from the tensor: keep it whole.
            return replicate_all(node, ins, self.ctx)
        for path, lay in narrowed.items():  # the rule read them as plain splits: each rank narrows to its part
            decision.wants.setdefault(path, lay)
        return decision

    def projected(self, node: fx.Node, proj: Projection, role: Role) -> Decision:
        """``projection``'s decision, kept in ``decisions`` when a search shares one: it reads nothing but the
        node, its role and what every propagation of the search shares (tp, ``grad``, no sequence split)."""
        if self.decisions is None:
            return self.projection(node, proj, role)
        key = (node, role)
        if key not in self.decisions:
            self.decisions[key] = self.projection(node, proj, role)
        return self.decisions[key]

    def role_of(self, proj: Projection, ins: dict) -> Role | None:
        weight = self.param_layouts.get(proj.weight)
        if isinstance(weight, Shard) and weight.dim == proj.out_dim and proj.packed is not None:
            weight = segment_of(weight, proj.packed)  # this projection's slice of the packed parameter
            if weight is None:
                return None  # a slice across segments: its rule (the split of the parameter) keeps it whole
        if isinstance(weight, Shard) and proj.experts > 1:
            segments = one_expert(proj, weight.segments)  # the parameter holds every expert's: this one's split
            if segments is None:
                return None
            weight = dataclasses.replace(weight, segments=segments)
        if isinstance(weight, Shard):
            if weight.dim == proj.out_dim:
                return Role(PlacementKind.COLWISE, weight.segments, weight.replicas)
            return None if proj.joined_bias else Role(PlacementKind.ROWWISE, _fused(weight.segments))
        x = self.graph_node(proj.input)
        x_layout = self.layout(x)
        features = self.index.rank(x) + proj.in_axis
        if self.auto_rows and not proj.joined_bias and _row_input(x_layout, features, proj.in_features):
            self.result.rows.append(proj.node)
            return Role(PlacementKind.ROWWISE, _fused(x_layout.segments))
        return None

    def graph_node(self, name: str) -> fx.Node:
        return self.nodes[name]

    def projection(self, node: fx.Node, proj: Projection, role: Role) -> Decision:
        x_path = next(p for p, n in tensor_args(node) if n.name == proj.input)
        x = self.graph_node(proj.input)
        if role.kind is PlacementKind.COLWISE:
            out = Shard(self.index.rank(node) + proj.out_axis, role.segments, replicas=role.replicas)
            wants = {x_path: COPY}
            if proj.joined_bias:  # its parts are split (or sliced) as the outputs are
                bias = next(p for p, n in tensor_args(node) if n.target is aten.cat.default)
                wants[bias] = Shard(0, role.segments, replicas=role.replicas)
            return Decision(out, wants=wants, checks=size_checks(out, "output features"))
        out = self.sequence_shard(node)
        wants = {x_path: Shard(self.index.rank(x) + proj.in_axis, role.segments or (proj.in_features,))}
        checks = [(size, "input features") for size in role.segments or (proj.in_features,)]
        flat = self.unflattened_row(node, proj)
        if flat is not None:
            return self.flattened_row(node, *flat, wants, checks)
        bias = next(((p, n) for p, n in tensor_args(node) if n.op == "get_attr" and n.target == proj.bias), None)
        if out is not None and bias is not None and bias[1].name in self.ctx.grad:
            wants[bias[0]] = COPY  # added after the reduce-scatter, to this rank's tokens: its gradient is a share
        return Decision(out, wants=wants, checks=checks, reduce=Operator.REDUCE_SCATTER if out else Operator.G)

    def unflattened_row(self, node: fx.Node, proj: Projection) -> tuple | None:
        """Under sequence parallelism, where a row layer computed on flattened tokens can reduce-scatter, and the
        biases added to it on the way (``sequence_flat.unflattened``); None elsewhere."""
        if not self.sequence or proj.spatial or self.sequence_shard(node) is not None:
            return None
        return unflattened(node, self.sequence,
                           lambda a: a.op == "get_attr" and self.param_layouts.get(a.target) is None)

    def flattened_row(self, node: fx.Node, flat: fx.Node, added: list, wants: dict, checks: list) -> Decision:
        """A row layer computed on flattened tokens under sequence parallelism: its partial sum reduce-scatters at
        ``flat``, where the sequence is a dim again, and its biases are added by one rank (``sequence_flat``)."""
        self.flat.add(flat.name)
        reduce_when_unflattened(self.result, node, flat, added)
        return Decision(None, wants=wants, checks=checks)

    def sequence_shard(self, node: fx.Node) -> Shard | None:
        """Under sequence parallelism, the split along the sequence that a reduction after ``node`` lands in (its
        first dim sized like the token ids' sequence); None without sequence parallelism or such a dim."""
        if not self.sequence:
            return None
        for dim, size in enumerate(sizes(node)):
            if sympy.sympify(size) in self.sequence:
                return Shard(dim, (size,))
        return None

    def sequence_lookup(self, node: fx.Node, emb: Embedding) -> Decision | None:
        """Under sequence parallelism, a whole table's lookup of a batch of ids along one sequence (token ids, not
        a [T, T] relative-position grid) looks up only this rank's ids: its output starts split along the
        sequence with no communication forward, and the table's gradient, a share, is all-reduced (``f``)."""
        ids = sizes(self.nodes[emb.ids])
        along = [d for d, size in enumerate(ids) if sympy.sympify(size) in self.sequence]
        if len(along) != 1 or all(size == 1 for d, size in enumerate(ids) if d != along[0]):
            # Ids shared by the batch (positions, [1, T]): slicing the small lookup costs less than all-reducing
            # the table's gradient, so the lookup stays whole and its reader slices it.
            return None
        wants = {(1,): Shard(along[0], (ids[along[0]],))}
        weight = node.args[0]
        if isinstance(weight, fx.Node) and weight.name in self.ctx.grad:
            wants[(0,)] = COPY
        return Decision(Shard(along[0], (ids[along[0]],)), wants=wants)

    def split_broadcast(self, source: fx.Node, have: Layout, want) -> bool:
        """Make a whole ``expand`` that only this consumer reads, wanted split along a dim it broadcast from size
        1, expand to this rank's part instead (its input whole, through ``f``), rather than slice it: a key part
        shared by every head (low-rank attention's rotary key) then costs an all-reduce of its small gradient, not
        an all-gather of the expanded one."""
        if not (have is None and isinstance(want, Shard) and want.blocks == 1 and want.replicas == 1
                and source.op == "call_function" and source.target is aten.expand.default and len(source.users) == 1):
            return False
        x, shape = source.args[0], source.args[1]
        d = want.dim - (rank(source) - rank(x))
        if d < 0 or sizes(x)[d] != 1 or shape[want.dim] != want.size or self.layout(x) is not None:
            return False
        self.result.layouts[source.name] = want
        self.result.fixes.append((source.name, (1, want.dim), chunk_size(want.size, want.chunks(self.ctx.tp))))
        self.convert(source, (0,), x, None, COPY if x.name in self.ctx.grad else None)
        return True

    def convert(self, node: fx.Node, path: ArgPath, source: fx.Node, have: Layout, want) -> None:
        steps = steps_between(have, want)
        if not steps:
            return
        key = (source.name, steps)
        conv = self.result.conversions.setdefault(key, Conversion(source.name, steps))
        conv.consumers.append((node.name, path))


def propagate(graph: fx.Graph, projections: Mapping[str, Projection], embeddings: Mapping[str, Embedding],
              param_layouts: Mapping[str, Shard], tp: int, trainable: set[str], auto_rows: bool = False,
              grad: set[str] | None = None, index: GraphIndex | None = None,
              sequence: frozenset = frozenset(), inputs: Mapping[str, Shard] | None = None,
              windowed: bool | None = None, decisions: dict | None = None, stop=None) -> Propagation:
    """Propagate the parameter layouts (keyed by ``get_attr`` target) through ``graph``.

    With ``auto_rows``, a projection that receives its input split along the features becomes
    row-split, which is how the planner discovers where a column-split region closes. ``windowed`` (the
    default with ``auto_rows``) visits only the split parameters' readers and the readers of split values, in
    graph order: a node that reads only whole values adds nothing, so a search that propagates one candidate per
    layer costs what each candidate's split reaches, not the graph's size. It leaves out the layouts of ``get_attr`` nodes (and a held
    chunk's ``SHARED_GRAD``): only for searches, never for the plan's own propagation, and never with ``sequence``
    or ``inputs`` (which split values no parameter reads). ``grad`` (the nodes gradients flow through) may be
    passed in when known.
    ``sequence`` (the sequence sizes, as sympy expressions) turns on sequence parallelism: the reductions after
    row-split projections and split lookups reduce-scatter along the sequence, and the values after them stay
    split along it (norms, dropout, residual adds per sequence shard) until a reader needs them whole.
    ``inputs`` (placeholder name -> Shard) are graph inputs each rank is given already split: a KV cache's tensors,
    placed like the K/V heads written into them.
    ``decisions`` caches the rules' decisions by node and input layouts (a rule reads nothing else): a search
    passes one dict to the many propagations it runs on one graph at one tp and ``grad``, whose walks meet the
    same values split the same way again (the residual stream of every later block).
    ``stop(node, result)`` (windowed walks only) ends the walk once it returns True, leaving the result unfinished:
    for a search that has learnt what it needed (``dead_ends.DeadEndWatch``).
    """
    windowed = auto_rows if windowed is None else windowed
    if windowed and (sequence or inputs):
        raise ValueError("a windowed propagation starts at the split parameters' readers, so it cannot take "
                         "sequence parallelism or split inputs (they split values before them)")
    grad = grad if grad is not None else grad_nodes(graph, trainable)
    walker = _Walker(graph, projections, embeddings, param_layouts, tp, grad, auto_rows, index or GraphIndex.of(graph),
                     frozenset(sympy.sympify(s) for s in sequence), inputs, decisions)
    if stop is not None and not windowed:
        raise ValueError("only a windowed propagation can stop early (a full one is the plan's own)")
    result = walker.run(windowed, stop)
    if not (windowed or auto_rows or sequence):  # sequence parallelism reduce-scatters where the rows are
        carry_partial_sums(result, walker.index.order, projections, grad)
    elif sequence and not (windowed or auto_rows):  # but adapters join their base's all-gather and reduce-scatter
        gather_into_flat_regions(result, walker.index.nodes)
        carry_sequence_sums(result, walker.index.order, projections, grad)
    if not (windowed or auto_rows) and tp > 1:  # DoRA's norms ride in their layer's reduction
        join_dora_norms(result, walker.index.order, projections, grad)
    return result
