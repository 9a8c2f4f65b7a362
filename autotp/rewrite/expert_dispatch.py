"""Expert parallelism by token dispatch: each rank holds ``E/ep`` whole experts of every bank placed
``PlacementKind.EXPERT``, and the rows routed to an expert travel to the rank holding it and back by all-to-all.

A grouped matmul ``grouped_mm(x, W, offs)`` multiplies the rows of ``x`` (sorted by expert; ``offs`` the cumulative
row count of each) by their expert's matrix. Its rows are whole on every tensor-parallel rank, so each of those
ranks dispatches its own share of them (``chunk_span`` over tp, as sequence parallelism cuts): across the
expert-parallel group every routed row is sent exactly once. Per chain of grouped matmuls (gate-up, then down):

- *route*: each rank's count of rows per expert (a few integers, all-gathered over the ep group) fixes the
  variable sizes of the exchanges (dropless: no capacity factor, nothing dropped);
- *dispatch* (all-to-all): the share's rows to their experts' ranks; rows sorted by expert go to consecutive ranks,
  so each destination's rows are one slice;
- the chain runs on the rows received, expert block by expert block, with whole experts' matrices;
- *combine* (all-to-all): the results back to the ranks they came from, in the order they were sent;
- at tp > 1 the shares are all-gathered over tp: the chain's output rows are whole again, as its readers expect.

Backward runs the same two all-to-alls in reverse (and, at tp > 1, the all-gather of the input rows' gradient
shares). Nothing is summed over ranks, so the experts' outputs are exact, row by row; each expert's weights get
the gradient of every row routed to it in the ep group, on the rank holding it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import fx, nn

from autotp.passes.grouped_banks import bank_of, expert_matmuls, offsets_of
from autotp.passes.placement import chunk_span
from autotp.passes.steps import Operator
from autotp.rewrite.comm import Communicator, all_gather_chunks


@dataclass(frozen=True)
class Route:
    """Where one chain's rows go on this rank, for one batch (fixed at run time from the routing)."""

    share: tuple[int, int]
    """(start, length) of the rows this rank dispatches, among the whole sorted rows."""
    sent: int
    """Rows of the share that belong to an expert (a grouped matmul leaves rows past its last offset alone)."""
    send: tuple[int, ...]
    """Rows sent to each ep rank."""
    receive: tuple[int, ...]
    """Rows received from each ep rank."""
    blocks: tuple[tuple[int, int], ...]
    """(local expert, rows) of the rows received, in order: each source rank's rows, expert by expert."""
    lengths: tuple[int, ...]
    """Each tensor-parallel rank's share length (what the tp all-gather reassembles)."""


def expert_counts(ends: list[int], start: int, stop: int) -> list[int]:
    """Rows of each expert within rows ``start`` to ``stop`` of rows sorted by expert (``ends``: each expert's
    cumulative end)."""
    starts = [0, *ends[:-1]]
    return [max(0, min(e, stop) - max(s, start)) for s, e in zip(starts, ends)]


def make_route(counts: list[list[int]], share: tuple[int, int], lengths: tuple[int, ...], ep_rank: int) -> Route:
    """The route from ``counts`` (each ep rank's rows per expert, in ep-rank order), this rank's ``share`` of the
    rows and every tp rank's share ``lengths``: experts are held ``E/ep`` consecutive ones per ep rank."""
    ep, experts = len(counts), len(counts[0])
    local = experts // ep
    mine = counts[ep_rank]
    send = tuple(sum(mine[p * local:(p + 1) * local]) for p in range(ep))
    first = ep_rank * local
    receive = tuple(sum(row[first:first + local]) for row in counts)
    blocks = tuple((j, row[first + j]) for row in counts for j in range(local))
    return Route(share, sum(mine), send, receive, blocks, lengths)


class ExpertRoute(nn.Module):
    """``(rows, offs) -> Route``: this rank's share of the rows and the all-gathered counts per expert."""

    def __init__(self, ep_comm: Communicator, tp_comm: Communicator | None):
        super().__init__()
        self.ep_comm, self.tp_comm = ep_comm, tp_comm

    def forward(self, x: torch.Tensor, offs: torch.Tensor) -> Route:
        """The route of ``x``'s rows (sorted by expert, ``offs`` their cumulative counts) on this rank."""
        tp, tp_rank = (self.tp_comm.size, self.tp_comm.rank) if self.tp_comm is not None else (1, 0)
        rows = x.shape[0]
        lengths = tuple(chunk_span(rows, tp, r)[1] for r in range(tp))
        start, length = chunk_span(rows, tp, tp_rank)
        mine = expert_counts(offs.tolist(), start, start + length)
        # a few integers per rank (the exchanges' sizes); an NCCL path sends these too (Megatron all-gathers them)
        counts = [c.tolist() for c in self.ep_comm.all_gather(torch.tensor(mine, dtype=torch.int64))]
        return make_route(counts, (start, length), lengths, self.ep_comm.rank)


class _Dispatch(torch.autograd.Function):
    """This rank's share of the rows to their experts' ranks (all-to-all); backward, their gradient back."""

    @staticmethod
    def forward(ctx, x, route: Route, comm: Communicator):
        ctx.route, ctx.comm, ctx.rows = route, comm, x.shape[0]
        start, _ = route.share
        return comm.all_to_all(x[start:start + route.sent], list(route.send), list(route.receive))

    @staticmethod
    def backward(ctx, grad):
        route = ctx.route
        back = ctx.comm.all_to_all(grad, list(route.receive), list(route.send))
        whole = back.new_zeros((ctx.rows, *back.shape[1:]))  # rows outside the share: another tp rank's gradient
        start, _ = route.share
        whole[start:start + route.sent] = back
        return whole, None, None


class _Combine(torch.autograd.Function):
    """The experts' results back to the ranks that sent the rows (all-to-all), as the share's rows (the rows no
    expert holds stay zero); backward, their gradient to the experts' ranks."""

    @staticmethod
    def forward(ctx, y, route: Route, comm: Communicator):
        ctx.route, ctx.comm = route, comm
        back = comm.all_to_all(y, list(route.receive), list(route.send))
        out = back.new_zeros((route.share[1], *back.shape[1:]))
        out[:route.sent] = back
        return out

    @staticmethod
    def backward(ctx, grad):
        route = ctx.route
        return ctx.comm.all_to_all(grad[:route.sent].contiguous(), list(route.send), list(route.receive)), None, None


class _GatherShares(torch.autograd.Function):
    """The tp ranks' shares of the rows, all-gathered into the whole rows; backward, this rank's share of the
    gradient (it is whole and alike on every tp rank)."""

    @staticmethod
    def forward(ctx, share, route: Route, comm: Communicator):
        ctx.route = route
        return torch.cat(all_gather_chunks(comm, share, 0, list(route.lengths)))

    @staticmethod
    def backward(ctx, grad):
        start, length = ctx.route.share
        return grad[start:start + length], None, None


class ExpertDispatch(nn.Module):
    """``(rows, route) -> rows received``: the dispatch all-to-all (``_Dispatch``); at tp > 1, the input rows'
    gradient shares all-gathered backward so that it is whole on every tp rank, as the rows are."""

    def __init__(self, ep_comm: Communicator, tp_comm: Communicator | None):
        super().__init__()
        self.ep_comm, self.tp_comm = ep_comm, tp_comm

    def forward(self, x: torch.Tensor, route: Route) -> torch.Tensor:
        """The rows this rank's experts are sent."""
        if self.tp_comm is not None:
            x = _WholeGrad.apply(x, route, self.tp_comm)
        return _Dispatch.apply(x, route, self.ep_comm)


class _WholeGrad(torch.autograd.Function):
    """Identity forward; backward, the tp ranks' gradient shares (each nonzero only in its share) all-gathered."""

    @staticmethod
    def forward(ctx, x, route: Route, comm: Communicator):
        ctx.route, ctx.comm = route, comm
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        start, length = ctx.route.share
        mine = grad[start:start + length].contiguous()
        return torch.cat(all_gather_chunks(ctx.comm, mine, 0, list(ctx.route.lengths))), None, None


class ExpertCombine(nn.Module):
    """``(rows computed, route) -> the chain's output rows``: the combine all-to-all; at tp > 1 the shares
    all-gathered."""

    def __init__(self, ep_comm: Communicator, tp_comm: Communicator | None):
        super().__init__()
        self.ep_comm, self.tp_comm = ep_comm, tp_comm

    def forward(self, y: torch.Tensor, route: Route) -> torch.Tensor:
        """The rows of this rank's share (at tp > 1, every rank's) with their experts' results."""
        out = _Combine.apply(y, route, self.ep_comm)
        return out if self.tp_comm is None else _GatherShares.apply(out, route, self.tp_comm)


def expert_blocks_mm(x: torch.Tensor, w: torch.Tensor, route: Route) -> torch.Tensor:
    """The rows received multiplied by their experts' matrices (``w``: this rank's experts), block by block."""
    out, start = [], 0
    for j, rows in route.blocks:
        # even an empty block reaches x and w in autograd: every rank runs the same exchanges backward
        out.append(torch.mm(x[start:start + rows], w[j]))
        start += rows
    return torch.cat(out)


def _chains(graph: fx.Graph, placements) -> list[list[fx.Node]]:
    """The grouped matmuls over split banks, grouped into chains (from one that starts a chain to the one ending
    it, in graph order)."""
    chains: list[list[fx.Node]] = []
    for mm, first, last in expert_matmuls(graph, placements):
        if first or not chains:
            chains.append([])
        chains[-1].append(mm)
        if last:
            chains.append([])
    return [c for c in chains if c]


def _inside(chain: list[fx.Node], received: fx.Node) -> list[fx.Node]:
    """The nodes computing on the rows received: from the dispatch to the chain's last grouped matmul."""
    last, found, frontier = chain[-1], [], [received]
    seen = {received}
    while frontier:
        frontier = [u for n in frontier for u in n.users if u not in seen and not seen.add(u)]
        found += frontier
        frontier = [n for n in frontier if n is not last]
    return [n for n in found if n is last or _reaches(n, last)]


def _reaches(node: fx.Node, target: fx.Node) -> bool:
    frontier, seen = [node], {node}
    while frontier:
        if target in frontier:
            return True
        frontier = [u for n in frontier for u in n.users if u not in seen and not seen.add(u)]
    return False


def _rows_of(node) -> object:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return str(val.shape[0]) if isinstance(val, torch.Tensor) and val.dim() else None


def _dispatch_rows_read_inside(gm: fx.GraphModule, chain: list[fx.Node], x: fx.Node, route: fx.Node,
                               received: fx.Node, dispatch: str) -> None:
    """Dispatch with the chain's rows any other per-row value an op inside the chain reads (GPT-OSS's bias picked
    per row, added to a grouped matmul's output): it must travel with its rows."""
    inside = _inside(chain, received)
    rows, members = _rows_of(x), set(inside) | {received}
    sent: dict[fx.Node, fx.Node] = {}
    for node in inside:
        for arg in node.all_input_nodes:
            if arg in members or arg.op == "get_attr" or _rows_of(arg) != rows or arg is route:
                continue
            if arg not in sent:
                with gm.graph.inserting_before(node):
                    sent[arg] = gm.graph.call_module(dispatch, (arg, route))
            node.replace_input_with(arg, sent[arg])


def dispatch_experts(gm: fx.GraphModule, placements: dict[str, object], ep_comm: Communicator,
                     tp_comm: Communicator | None) -> None:
    """Make this rank's graph dispatch every chain of grouped matmuls over banks placed ``EXPERT``
    (``placements``: ``get_attr`` target -> placement) to the ep ranks holding the experts, and combine back."""
    graph = gm.graph
    for count, chain in enumerate(_chains(graph, placements)):
        first, last = chain[0], chain[-1]
        x, offs = first.args[0], offsets_of(first)
        for kind, module in (("route", ExpertRoute), ("dispatch", ExpertDispatch), ("combine", ExpertCombine)):
            gm.add_submodule(f"autotp_expert_{kind}_{count}", module(ep_comm, tp_comm))
        with graph.inserting_before(first):
            route = graph.call_module(f"autotp_expert_route_{count}", (x, offs))
            received = graph.call_module(f"autotp_expert_dispatch_{count}", (x, route))
        for mm in chain:
            assert bank_of(mm.args[1]) is not None  # expert_matmuls chose it by its bank
            rows = received if mm is first else mm.args[0]
            mm.target, mm.args, mm.kwargs = expert_blocks_mm, (rows, mm.args[1], route), {}
        _dispatch_rows_read_inside(gm, chain, x, route, received, f"autotp_expert_dispatch_{count}")
        users = list(last.users)
        with graph.inserting_after(last):
            combined = graph.call_module(f"autotp_expert_combine_{count}", (last, route))
        for user in users:
            user.replace_input_with(last, combined)
    graph.lint()
    gm.recompile()


EXPERT_IMPLEMENTATIONS: dict[Operator, type[nn.Module]] = {
    Operator.ROUTE: ExpertRoute, Operator.DISPATCH: ExpertDispatch, Operator.COMBINE: ExpertCombine}
"""The modules that run the expert operators (``passes.steps.COMMUNICATION`` describes them), each made with the
ep and tp communicators (``collectives.IMPLEMENTATIONS`` holds those made from one communicator and a shard)."""
