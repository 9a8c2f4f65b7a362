"""Expert parallelism for a loop over the experts (``passes.loop_banks``): each rank holds ``E/ep`` whole experts of
the loop's banks, and every expert's rows travel to the rank holding it and back by one all-to-all each way.

The captured loop runs every expert in turn on its tokens' rows (``x[tokens]``). Rewritten, the rows of all the
experts are laid end to end, expert after expert (sorted by expert, as a grouped matmul's are), and go through
the same route, dispatch and combine as grouped matmuls (``rewrite.expert_dispatch``): one all-to-all carrying
every routed row once each way. Each rank runs its own experts' chains on the rows it received, expert by expert,
with its slices of the banks; the results come back in the order the rows were sent and are cut apart again per
expert, where the loop's iteration continues as the model wrote it (the router's weighting, the ``index_add_``).
Nothing is summed over ranks: each row's result is the one the model computes.
"""

from __future__ import annotations

import operator

import torch
from torch import fx

from autotp.passes.loop_banks import BankLoop, bank_loops
from autotp.rewrite.comm import Communicator
from autotp.rewrite.expert_dispatch import ExpertCombine, ExpertDispatch, ExpertRoute, Route


def row_offsets(rows: list[torch.Tensor]) -> torch.Tensor:
    """Each expert's cumulative end among ``rows`` laid end to end (a grouped matmul's ``offs``)."""
    return torch.tensor([r.shape[0] for r in rows], dtype=torch.int64).cumsum(0)


def received_rows(received: torch.Tensor, route: Route, local: int) -> torch.Tensor:
    """The rows received for local expert ``local``: its block from every source rank, in rank order."""
    out, start = [], 0
    for j, rows in route.blocks:
        if j == local:
            out.append(received[start:start + rows])
        start += rows
    return torch.cat(out)


def in_received_order(results: list[torch.Tensor], route: Route) -> torch.Tensor:
    """The local experts' ``results`` (each over its rows from every source rank, in rank order) put back in the
    order the rows were received: source rank by source rank, expert by expert."""
    taken = [0] * len(results)
    out = []
    for j, rows in route.blocks:
        out.append(results[j][taken[j]:taken[j] + rows])
        taken[j] += rows
    return torch.cat(out)


def _stable_topological(graph: fx.Graph) -> None:
    """Reorder ``graph`` so that every node follows its inputs, moving as little as possible (a node waits only
    for inputs placed after it)."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    placed: list[fx.Node] = []
    done: set[fx.Node] = set()
    waiting: dict[fx.Node, list[fx.Node]] = {}

    def place(node):
        stack = [node]
        while stack:
            n = stack.pop()
            placed.append(n)
            done.add(n)
            for w in sorted(waiting.pop(n, ()), key=order.__getitem__, reverse=True):
                if w not in done and all(a in done for a in w.all_input_nodes):
                    stack.append(w)

    for node in list(graph.nodes):
        missing = [a for a in node.all_input_nodes if a not in done]
        if missing:
            for a in missing:
                waiting.setdefault(a, []).append(node)
        else:
            place(node)
    assert len(placed) == len(order), "a cycle in the rewritten loop"
    anchor = placed[0]
    for node in placed[1:]:
        if anchor.next is not node:
            anchor.append(node)
        anchor = node


def _dispatch_loop(gm: fx.GraphModule, loop: BankLoop, count: int, ep_comm: Communicator,
                   tp_comm: Communicator | None) -> None:
    graph = gm.graph
    chains = loop.chains
    local = len(chains) // ep_comm.size
    first = ep_comm.rank * local
    for kind, module in (("route", ExpertRoute), ("dispatch", ExpertDispatch), ("combine", ExpertCombine)):
        gm.add_submodule(f"autotp_loop_{kind}_{count}", module(ep_comm, tp_comm))
    last_rows = max((c.rows for c in chains), key=list(graph.nodes).index)
    with graph.inserting_after(last_rows):
        rows = [c.rows for c in chains]
        whole = graph.call_function(torch.cat, (rows,))
        offs = graph.call_function(row_offsets, (rows,))
        route = graph.call_module(f"autotp_loop_route_{count}", (whole, offs))
        received = graph.call_module(f"autotp_loop_dispatch_{count}", (whole, route))
    results = []
    for j, chain in enumerate(chains[first:first + local]):
        with graph.inserting_after(received):
            mine = graph.call_function(received_rows, (received, route, j))
        for node in chain.nodes:
            node.replace_input_with(chain.rows, mine)
        for select in chain.selects:  # this rank's bank holds its experts only: expert first + j is its j-th
            select.args = (select.args[0], 0, j)
        results.append(chain.end)
    with graph.inserting_before(list(graph.nodes)[-1]):
        back = graph.call_function(in_received_order, (results, route))
        combined = graph.call_module(f"autotp_loop_combine_{count}", (back, route))
        sizes = [graph.call_function(torch.ops.aten.sym_size.int, (c.rows, 0)) for c in chains]
        parts = graph.call_function(torch.split, (combined, sizes))
        outs = [graph.call_function(operator.getitem, (parts, i)) for i in range(len(chains))]
    for chain, out in zip(chains, outs):
        for user in [u for u in chain.end.users if u is not back]:
            user.replace_input_with(chain.end, out)
    for chain in chains[:first] + chains[first + local:]:  # other ranks' experts: their chains run there
        for node in reversed(chain.nodes):
            graph.erase_node(node)


def dispatch_loops(gm: fx.GraphModule, placements: dict[str, object], ep_comm: Communicator,
                   tp_comm: Communicator | None) -> None:
    """Make this rank's graph run every loop over the experts whose banks are all placed ``EXPERT``
    (``placements``: ``get_attr`` target -> placement) on the ranks holding the experts, by all-to-all."""
    loops = [loop for loop in bank_loops(gm.graph)[0] if all(t in placements for t in loop.banks)]
    for count, loop in enumerate(loops):
        _dispatch_loop(gm, loop, count, ep_comm, tp_comm)
    if loops:
        _stable_topological(gm.graph)
        gm.graph.lint()
        gm.recompile()
