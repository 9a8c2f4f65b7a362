"""The banks of experts that a captured loop over the experts reads, found in a graph (read-only).

Eager mixture-of-experts code loops over the experts a batch routes tokens to (``for e in hit.nonzero()``) and
runs each on its tokens' rows with its slice of a bank (``F.linear(x[tokens], W[e])``). The capture unrolls the
loop over every expert (``capture.fallbacks.routed_loops``), tagging each iteration's nodes with ``ITERATION``.
In each iteration the expert's *chain* is what expert parallelism moves to the rank holding the expert: from
the rows it reads (``x[tokens]``, one per-row input) to the last op reading the expert's slice of a bank (the
down projection, or its bias added after it), whose output alone leaves the chain (the router's weighting, the
``index_add_`` back into token order stay where the tokens are). ``rewrite.loop_dispatch`` rewrites them.

A loop is split only when every expert of its banks has such a chain: a loop captured over the experts the
example routed to only (its body could not run for the others) keeps tensor parallelism.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import fx

from autotp.passes.grouped_banks import bank_of

aten = torch.ops.aten

ITERATION = "autotp_routed_iteration"
"""``node.meta["custom"]`` key naming the loop and expert of each node traced inside a routed loop's body."""


@dataclass(frozen=True)
class ExpertChain:
    """One expert's computation inside one iteration of a loop over the experts."""

    expert: int
    rows: fx.Node
    """The per-row input the chain reads (the expert's tokens' rows)."""
    nodes: tuple[fx.Node, ...]
    """The chain's nodes in graph order (the weight reads included), ending with ``end``."""
    selects: tuple[fx.Node, ...]
    """The ``select(bank, 0, expert)`` reads of the expert's slices of its banks."""
    end: fx.Node
    """The chain's last node: the only one read outside it."""


@dataclass(frozen=True)
class BankLoop:
    """A loop over the experts whose every expert has a chain over the same banks."""

    chains: tuple[ExpertChain, ...]
    """One per expert, in expert order."""
    banks: dict
    """``get_attr`` target -> experts, of every bank the chains read."""


def iteration(node: fx.Node):
    """The (loop, expert) of the loop iteration ``node`` was traced in, or None."""
    return (node.meta.get("custom") or {}).get(ITERATION)


def _expert_select(node: fx.Node, expert: int) -> fx.Node | None:
    """The bank ``node`` reads expert ``expert``'s slice of (``select(bank, 0, expert)``), or None."""
    if node.op != "call_function" or node.target is not aten.select.int or node.args[1:] != (0, expert):
        return None
    val = node.meta.get("val")  # a matrix (or a bias) of weights, not the loop's constant expert index
    return bank_of(node.args[0]) if isinstance(val, torch.Tensor) and val.is_floating_point() and val.dim() else None


def _weights(nodes: list[fx.Node], expert: int) -> tuple[set[fx.Node], list[fx.Node]]:
    """The nodes computed from the expert's slices of banks only (the slices, cast or transposed), and the
    selects."""
    selects = [n for n in nodes if _expert_select(n, expert) is not None]
    weights = set(selects)
    for node in nodes:
        ins = [a for a in node.all_input_nodes if a.op != "get_attr"]
        if node not in weights and ins and all(a in weights for a in ins):
            weights.add(node)
    return weights, selects


def _between(start: fx.Node, end: fx.Node, inside: set[fx.Node]) -> set[fx.Node]:
    """The nodes of ``inside`` on a path from ``start`` to ``end`` (``end`` included, ``start`` not)."""
    down, frontier = set(), [start]
    while frontier:
        frontier = [u for n in frontier for u in n.users if u in inside and u not in down and not down.add(u)]
    up, frontier = {end}, [end]
    while frontier:
        frontier = [a for n in frontier for a in n.all_input_nodes if a in down and a not in up and not up.add(a)]
    return up


def _rows(node: fx.Node) -> str | None:
    """A value's row count, as text (an unbacked size compares by name, never by a data-dependent guard)."""
    val = node.meta.get("val")
    return str(val.shape[0]) if isinstance(val, torch.Tensor) and val.dim() else None


def expert_chain(nodes: list[fx.Node], expert: int) -> ExpertChain | str | None:
    """The chain of one iteration (``nodes``, in graph order) of expert ``expert``; None when it reads no bank
    (the class for no expert, skipped), or why it cannot be moved to another rank."""
    weights, selects = _weights(nodes, expert)
    if not selects:
        return None
    reading = [n for n in nodes if n not in weights and any(a in weights for a in n.all_input_nodes)]
    first, end = reading[0], reading[-1]
    rows = [a for a in first.all_input_nodes if a not in weights and a.op != "get_attr"]
    if len(rows) != 1 or _rows(rows[0]) is None:
        return f"expert {expert}'s first matmul reads {len(rows)} per-row inputs, not its tokens' rows alone"
    chain = _between(rows[0], end, set(nodes))
    chain |= weights  # the expert's reads of its slices (cast, transposed, their checks): they move with it
    for node in nodes:  # checks on the chain's values (a dtype assertion), which nothing reads
        if not node.users and node.all_input_nodes and all(a in chain for a in node.all_input_nodes):
            chain.add(node)
    outside = [n for n in chain if n is not end and any(u not in chain for u in n.users)]
    if outside:
        return f"expert {expert}'s `{outside[0].name}` is read outside its chain"
    foreign = [a for n in chain for a in n.all_input_nodes
               if a not in chain and a is not rows[0] and a.op != "get_attr" and _rows(a) == _rows(rows[0])]
    if foreign:
        return f"expert {expert}'s chain reads another per-row value (`{foreign[0].name}`) than its rows"
    if _rows(end) != _rows(rows[0]):
        return f"expert {expert}'s chain ends in `{end.name}`, which does not keep one output row per input row"
    order = {n: i for i, n in enumerate(nodes)}
    return ExpertChain(expert, rows[0], tuple(sorted(chain, key=order.__getitem__)), tuple(selects), end)


def bank_loops(graph: fx.Graph) -> tuple[list[BankLoop], list[str]]:
    """Every loop over the experts of ``graph`` that reads banks with a chain for each of their experts, and why
    each other loop reading banks does not qualify."""
    by_iteration: dict[tuple, list[fx.Node]] = {}
    for node in graph.nodes:
        key = iteration(node)
        if key is not None:
            by_iteration.setdefault(tuple(key), []).append(node)
    loops: dict[int, list] = {}
    for (loop, expert), nodes in by_iteration.items():
        loops.setdefault(loop, []).append(expert_chain(nodes, expert))
    found, why = [], []
    for loop, chains in sorted(loops.items()):
        reasons = [c for c in chains if isinstance(c, str)]
        chains = [c for c in chains if isinstance(c, ExpertChain)]
        if reasons:
            why.append(reasons[0])
            continue
        if not chains:
            continue
        banks = {bank_of(s.args[0]).target: int(s.args[0].meta["val"].shape[0]) for c in chains for s in c.selects}
        experts = sorted(c.expert for c in chains)
        if len(set(banks.values())) != 1 or experts != list(range(next(iter(banks.values())))):
            why.append(f"the loop runs {len(experts)} experts of banks holding {sorted(set(banks.values()))}: it was "
                       "captured over the experts the example routes to only")
        else:
            found.append(BankLoop(tuple(sorted(chains, key=lambda c: c.expert)), banks))
    return found, why


def loop_banks(graph: fx.Graph) -> dict[str, int]:
    """The ``get_attr`` target of every bank a splittable loop over the experts reads, with its experts."""
    return {t: e for loop in bank_loops(graph)[0] for t, e in loop.banks.items()}
