"""Where a model can be cut into pipeline stages: points where the graph narrows to one hidden state.

Walking the graph in order, a cut after position i is possible when exactly one value computed from
parameters is still needed later: the hidden state, which carries the gradient and is all the next stage
must receive. A value computed from frozen parameters and the inputs (a frozen embedding's output, the
residual stream of a peft model before its first adapter) counts as well, though no gradient flows through
it: it too would have to cross. Values computed only from the inputs and buffers (attention masks, position
ids, RoPE tables) do not count: every stage recomputes them from the model inputs, which each stage
receives. Module names play no part; they only label the result.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import torch
from torch import fx

from autotp.passes.graph import frozen_activations, frozen_attrs, grad_nodes, is_tensor, rank
from autotp.torch_private import set_grad_enabled_op


@dataclass(frozen=True)
class Cut:
    """A possible stage boundary: everything up to ``position`` goes before, ``value`` crosses over."""

    value: str
    """The node whose tensor is sent to the next stage."""
    position: int
    """Index (in graph order) of the last node before the boundary."""


def param_users(graph: fx.Graph, trainable: set[str]) -> list[str]:
    """Nodes that read a trainable parameter directly, in graph order (where the work of a stage is)."""
    return [n.name for n in graph.nodes if n.op == "call_function"
            and any(a.op == "get_attr" and a.target in trainable for a in n.all_input_nodes)]


def _first_of_runs(cuts: list[Cut], weighted: list[int]) -> list[Cut]:
    """One cut per run of cuts with no parameter-reading node between them (the earliest of the run).

    Cuts with nothing but reshapes and casts between them would make empty stages.
    """
    kept: list[Cut] = []
    for cut in cuts:
        if not kept or any(kept[-1].position < w <= cut.position for w in weighted):
            kept.append(cut)
    return kept


def find_cuts(graph: fx.Graph, trainable: set[str], grad: set[str] | None = None,
              frozen: set[str] | None = None) -> list[Cut]:
    """Every place the parameter-dependent dataflow narrows to a single hidden-state tensor, in graph order.
    ``grad`` (``graph.grad_nodes``) may be passed in when known; ``frozen`` (the frozen parameters' targets) defaults
    to the graph's module's parameters that do not require grad."""
    # An fx graph lists every node after its inputs: its own order is the walk's order (a topological order that
    # takes the earliest node ready at each step), with no dataflow graph to build and sort.
    order = [n.name for n in graph.nodes]
    position = {name: i for i, name in enumerate(order)}
    nodes = {n.name: n for n in graph.nodes}
    grad = grad_nodes(graph, trainable) if grad is None else grad
    computed = {n for n in grad if nodes[n].op == "call_function"}
    # Frozen activations must cross too, so they block a cut (sizes read off them do not: they are numbers).
    frozen = frozen_attrs(graph.owning_module) - set(trainable) if frozen is None else frozen
    held = {n for n in frozen_activations(graph, frozen, grad) if is_tensor(nodes[n])}
    last_use = {n: max((position[u.name] for u in nodes[n].users), default=position[n]) for n in computed | held}
    remaining = len(computed)
    without_grad = _inside_no_grad(graph)
    live: set[str] = set()
    cuts: list[Cut] = []
    for i, name in enumerate(order):
        if name in computed:
            live.add(name)
            remaining -= 1
        elif name in held:
            live.add(name)
        live = {v for v in live if last_use[v] > i}
        if remaining and len(live) == 1 and name not in without_grad:
            (value,) = live
            node = nodes[value]
            if (value in computed and is_tensor(node) and rank(node) >= 2 and value not in without_grad
                    and (not cuts or cuts[-1].value != value)):
                cuts.append(Cut(value, i))
    weighted = [position[n] for n in param_users(graph, trainable)]
    return _first_of_runs(cuts, weighted)


def _inside_no_grad(graph: fx.Graph) -> set[str]:
    """Nodes after which gradients are off (between ``_set_grad_enabled(False)`` and the call restoring the
    mode, as capture inlines a no-grad part): a stage ending there would leave them off for the next, and a
    value made there carries no gradient back across a stage boundary."""
    inside, depth = set(), 0
    for node in graph.nodes:
        if node.op == "call_function" and node.target is set_grad_enabled_op():
            depth += 1 if node.args[0] is False else -1
        if depth > 0:
            inside.add(node.name)
    return inside


def unit_index(cuts: list[Cut], position: int) -> int:
    """The unit (run of nodes between consecutive cuts, in graph order as ``find_cuts`` gives them) holding graph
    position ``position``."""
    return bisect.bisect_left(cuts, position, key=lambda c: c.position)


def module_starts(analysis) -> dict[str, int]:
    """Each module (and every dotted prefix of it) -> graph position of its first parameter reader.

    A stage that starts at a module starts at the last cut before this position (``analysis`` is a
    ``passes.analysis.Analysis``).
    """
    positions = {n.name: i for i, n in enumerate(analysis.graph.nodes)}
    starts: dict[str, int] = {}
    for name in param_users(analysis.graph, analysis.trainable):
        path = analysis.module(name).split(".")
        for depth in range(1, len(path) + 1):
            starts.setdefault(".".join(path[:depth]), positions[name])
    starts.pop("", None)
    return starts
