"""The picture's content as plain data: nodes coloured by decision, collectives as nodes, stage clusters.

``viz_graph`` reads a captured model and its plan and returns a ``VizGraph``; the renderers (matplotlib,
DOT) only draw it. Identical repeated blocks collapse into one node per run (each stage keeps its first
block drawn in full), and a collapsed node's tooltip names the split modules it stands for.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import networkx as nx

from autotp.capture import Captured
from autotp.names import block_of, within
from autotp.passes.steps import Direction, Operator
from autotp.planning import Collective, PlacementKind, Plan
from autotp.tools.report import ParamInfo, collective_bytes, human_bytes, human_count, shard_shape
from autotp.tools.viz.groups import module_groups, op_summary


class Box(str, Enum):
    """What a node of the picture is when it is not a module with parameters (those show their placement)."""

    OPS = "ops"
    """A group of ops without parameters (the attention core, a residual add)."""
    IO = "io"
    """The model's inputs and output."""
    COLLECTIVE = "collective"
    """A communication the rewrite inserts."""
    COLLAPSED = "collapsed"
    """A run of blocks identical to one drawn in full."""


Decision = PlacementKind | Box
"""What a node shows, which sets its colour: a module's placement kind, or one of the other boxes."""

SPLIT = {PlacementKind.COLWISE, PlacementKind.ROWWISE, PlacementKind.VOCAB, PlacementKind.EXPERT}


@dataclass(frozen=True)
class VizNode:
    """One box of the picture."""

    id: str
    title: str
    """First line: the module's full name, or what the ops are."""
    detail: str
    """Second line: class, decision and shapes; ops; bytes."""
    decision: Decision
    module: str = ""
    stage: int | None = None
    tooltip: str = ""
    """Extra text for readers who hover (SVG/HTML title, DOT tooltip)."""


@dataclass(frozen=True)
class VizGraph:
    """Nodes in drawing order (topological), edges between their ids, stage labels, and a title."""

    nodes: tuple[VizNode, ...]
    edges: tuple[tuple[str, str], ...]
    stages: tuple[tuple[int, str], ...]
    title: str
    subtitle: str


def _shape(shape) -> str:
    return "×".join(map(str, shape))


def _decision(plan: Plan, params: list[str], io: bool) -> Decision:
    if io:
        return Box.IO
    if not params:
        return Box.OPS
    split = [p for p in params if p in plan.placements and plan.placements[p].is_split]
    if not split:
        return PlacementKind.REPLICATED
    weight = next((p for p in split if p.endswith("weight")), split[0])
    return plan.placements[weight].kind


def _node_text(data: dict, decision: Decision, plan: Plan, infos: dict[str, ParamInfo]) -> tuple[str, str]:
    if decision is Box.IO:
        return ("input" if data["ops"] == ["input"] else "output"), ""
    if decision is Box.OPS:
        return (data["module"] or "(top level)"), f"{data['cls']} · {op_summary(data['ops'])}".lstrip(" ·")
    weight = next((p for p in data["params"] if p.endswith("weight")), data["params"][0])
    title = data["module"] or weight
    if decision is PlacementKind.REPLICATED or weight not in infos:
        return title, f"{data['cls']} · replicated".lstrip(" ·")
    full = infos[weight].shape
    shard = shard_shape(full, plan.placements[weight], plan.tp)
    return title, f"{data['cls']} · {decision.word} {_shape(full)} → {_shape(shard)}".lstrip(" ·")


def _collective_text(c: Collective, batch: int, seq: int) -> tuple[str, str]:
    op = c.op.value.replace("_", "-")
    title = f"{op} ({c.operator.value}, {c.direction.value})"
    return title, f"{human_bytes(collective_bytes(c, batch, seq))} · [{', '.join(c.shape)}]"


_SITS_AT = {Operator.F: (PlacementKind.VOCAB, PlacementKind.COLWISE),
            Operator.SCATTER: (PlacementKind.VOCAB, PlacementKind.COLWISE),
            Operator.G: (PlacementKind.ROWWISE,), Operator.VOCAB_EMBEDDING: (PlacementKind.VOCAB,),
            Operator.GATHER: (PlacementKind.VOCAB,), Operator.MEAN: (PlacementKind.COLWISE,)}
"""The placements of the boxes each Megatron operator sits at, the likelier first."""


def _anchor(g: nx.DiGraph, c: Collective, nth: int) -> str | None:
    """The box collective ``c`` belongs to: the ``nth`` box under ``c.module`` whose decision fits its
    operator (a module of bare parameters holds several projections), else any box of the module."""
    def inside(n):
        module = g.nodes[n].get("module", "")
        return g.nodes[n].get("decision") is not Box.COLLECTIVE and within(module, c.module)

    lookup = c.operator is Operator.VOCAB_EMBEDDING  # the embedding's lookup, not the LM head that may share its weight
    order = sorted((n for n in g if inside(n)), key=lambda n: g.nodes[n]["index"])
    for decision in _SITS_AT.get(c.operator, ()):
        fits = [n for n in order if g.nodes[n]["decision"] is decision and
                (decision is not PlacementKind.VOCAB or ("embedding" in g.nodes[n]["ops"]) == lookup)]
        if fits:
            return fits[min(nth, len(fits) - 1)]
    return (order[-1] if c.direction is Direction.FORWARD else order[0]) if order else None


def _insert_collective(g: nx.DiGraph, cid: str, c: Collective, data: dict, nth: int) -> None:
    """Put collective ``cid`` on the edges it sits on: after its box in the forward pass, before it
    (on the inputs of every split consumer of the same tensor) when it runs in the backward pass."""
    after = c.direction is Direction.FORWARD
    anchor = _anchor(g, c, nth)
    g.add_node(cid, **data, index=(g.nodes[anchor]["index"] if anchor else 0) + (0.5 if after else -0.5))
    if anchor is None:
        return
    if after:
        for succ in [s for s in g.successors(anchor) if s != cid]:
            g.remove_edge(anchor, succ)
            g.add_edge(cid, succ)
        g.add_edge(anchor, cid)
        return
    block = block_of(c.module)
    for pred in list(g.predecessors(anchor)):
        targets = [s for s in g.successors(pred) if s == anchor or (
            g.nodes[s].get("decision") in SPLIT and block_of(g.nodes[s].get("module", "")) == block)]
        for t in targets:
            g.remove_edge(pred, t)
            g.add_edge(cid, t)
        g.add_edge(pred, cid)
    if not g.in_degree(cid):
        g.add_edge(cid, anchor)


def _stage_of_module(plan: Plan, module: str) -> int | None:
    for stage in plan.stages:
        if any(within(module, m) for m in stage.modules if m):
            return stage.index
    return None


def _assign_stages(g: nx.DiGraph, plan: Plan) -> None:
    """Each node's stage: by module name; ops outside any stage's modules take their inputs' stage."""
    if not plan.stages:
        return
    for n in _order(g):
        data = g.nodes[n]
        stage = _stage_of_module(plan, data.get("module", "")) if data.get("module") else None
        if stage is None:
            preds = [g.nodes[p]["stage"] for p in g.predecessors(n) if g.nodes[p].get("stage") is not None]
            stage = max(preds) if preds else None
        data["stage"] = stage
    for n in reversed(_order(g)):  # inputs and sources: the stage of what reads them
        if g.nodes[n]["stage"] is None:
            succs = [g.nodes[s]["stage"] for s in g.successors(n) if g.nodes[s]["stage"] is not None]
            g.nodes[n]["stage"] = min(succs) if succs else plan.stages[0].index


def _order(g: nx.DiGraph) -> list[str]:
    return list(nx.lexicographical_topological_sort(g, key=lambda n: (g.nodes[n]["index"], n)))


def _block_runs(g: nx.DiGraph) -> tuple[list[list[str]], dict[str, list[str]]]:
    """Runs of consecutive identical blocks in one stage (the first stays drawn; the rest collapse),
    and the nodes of every block."""
    blocks: dict[str, list[str]] = {}
    for n in _order(g):
        block = block_of(g.nodes[n].get("module", ""))
        if block and g.nodes[n]["decision"] is not Box.IO:
            blocks.setdefault(block, []).append(n)

    def signature(block: str):
        return tuple((g.nodes[n]["title"].replace(block, "#", 1), g.nodes[n]["detail"], g.nodes[n]["decision"],
                      g.nodes[n].get("stage")) for n in blocks[block])

    runs, head = [], None
    for block in blocks:
        if head is not None and signature(block) == signature(head):
            runs[-1].append(block)
        else:
            head = block
            runs.append([block])
    return [run for run in runs if len(run) > 1], blocks


def _collapse(g: nx.DiGraph) -> nx.DiGraph:
    """Each run of repeated blocks as one node (kept only if the graph stays acyclic)."""
    runs, blocks = _block_runs(g)
    rep = {n: n for n in g}
    attrs = {n: g.nodes[n] for n in g}
    for i, (head, *run) in enumerate(runs):
        cid = f"blocks{i}"
        members = [n for b in run for n in blocks[b]]
        split = [g.nodes[n]["module"] for n in members if g.nodes[n]["decision"] in SPLIT]
        collectives = sum(g.nodes[n]["decision"] is Box.COLLECTIVE for n in members)
        first = g.nodes[members[0]]
        title = run[0] if len(run) == 1 else f"{run[0]} … {run[-1]}"
        detail = f"{len(run)} block{'s' * (len(run) > 1)} like {head} · {collectives} collectives"
        attrs[cid] = dict(title=title, detail=detail, decision=Box.COLLAPSED, module=run[0],
                          stage=first.get("stage"), index=first["index"], tooltip="split modules: " + ", ".join(split))
        rep.update({n: cid for n in members})
    out = nx.DiGraph()
    out.add_nodes_from((r, attrs[r]) for r in dict.fromkeys(rep.values()))
    out.add_edges_from((rep[u], rep[v]) for u, v in g.edges if rep[u] != rep[v])
    return out if nx.is_directed_acyclic_graph(out) else g


def _split_sources(g: nx.DiGraph) -> None:
    """Draw a shared source (rotary tables, a position embedding) once beside each reader: one long edge
    per reader across the whole picture would hide the structure."""
    shared = [n for n in g if not g.in_degree(n) and g.out_degree(n) > 1 and g.nodes[n]["decision"] is not Box.IO]
    for n in shared:
        for k, succ in enumerate(list(g.successors(n))):
            near = {"index": g.nodes[succ]["index"] - 0.25, "stage": g.nodes[succ].get("stage")}
            copy = f"{n}.{k}"
            g.add_node(copy, **(g.nodes[n] | near))
            g.add_edge(copy, succ)
        g.remove_node(n)


def viz_graph(captured: Captured, plan: Plan, infos: dict[str, ParamInfo], batch: int, seq: int,
              collapse: bool = True) -> VizGraph:
    """The picture of ``plan`` on ``captured``: decisions, collectives with bytes at ``batch``/``seq``, stages."""
    g = module_groups(captured)
    for n in g:
        data = g.nodes[n]
        data["decision"] = _decision(plan, data["params"], data["io"])
        data["title"], data["detail"] = _node_text(data, data["decision"], plan, infos)
    seen: dict[tuple[str, str], int] = {}
    for i, c in enumerate(plan.collectives):
        title, detail = _collective_text(c, batch, seq)
        nth = seen[(c.module, c.operator)] = seen.get((c.module, c.operator), -1) + 1
        _insert_collective(g, f"c{i}", c, dict(title=title, detail=detail, decision=Box.COLLECTIVE,
                                                module=c.module, io=False), nth)
    _assign_stages(g, plan)
    if collapse:
        g = _collapse(g)
    _split_sources(g)
    nodes = tuple(VizNode(n, g.nodes[n]["title"], g.nodes[n]["detail"], g.nodes[n]["decision"],
                          g.nodes[n].get("module", ""), g.nodes[n].get("stage"), g.nodes[n].get("tooltip", ""))
                  for n in _order(g))
    stages = tuple((s.index, f"stage {s.index} · {human_count(s.flops)}FLOP/rank · {human_count(s.param_count)} params"
                             f" · {human_bytes(s.activation_bytes)} activations") for s in plan.stages)
    split = sum(p.is_split for p in plan.placements.values())
    total = sum(collective_bytes(c, batch, seq) or 0 for c in plan.collectives)
    subtitle = (f"{split}/{len(plan.placements)} parameters split · {len(plan.collectives)} collectives, "
                f"{human_bytes(total)} per step at batch {batch}, seq {seq}")
    return VizGraph(nodes, tuple(g.edges), stages, f"{plan.model or 'model'} · tp={plan.tp} · pp={plan.pp}", subtitle)
