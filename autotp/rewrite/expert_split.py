"""Expert parallelism over the tensor-parallel ranks: each rank holds whole experts of every bank placed
``PlacementKind.EXPERT`` (its ``E/ep`` consecutive experts) and computes their rows only.

A grouped matmul ``grouped_mm(x, W, offs)`` multiplies the rows of ``x`` (sorted by expert; ``offs`` the
cumulative row count of each) by their expert's matrix. The tokens are whole on every tensor-parallel rank, so
each rank computes the rows of its own experts (``local_grouped_mm``), zeros elsewhere, and a chain of grouped
matmuls (gate-up, then down) becomes a sum over the ranks: Megatron's ``g`` (all-reduce) after the chain's last
matmul, its ``f`` (all-reduce of the gradient) on the chain's input. Between them a rank's rows of other experts
are never read by a later matmul, so what ops between compute on them does not matter; in backward, the rows of
other experts get no gradient from a rank, and the ``f`` sums each row's from the rank that owns its expert.
Each expert's weights get their whole gradient on the rank holding them, from every token routed to it.
"""

from __future__ import annotations

import torch
from torch import fx

from autotp.passes.grouped_banks import bank_of, expert_matmuls, offsets_of
from autotp.passes.placement import chunk_span
from autotp.rewrite.collectives import CopyToTP, ReduceFromTP


def local_grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, first: int) -> torch.Tensor:
    """``grouped_mm(x, W, offs)``'s rows of experts ``first`` to ``first + len(w) - 1`` (``w``: their matrices),
    zeros for the rows of other experts."""
    out = x.new_zeros((x.shape[0], w.shape[-1]))
    ends = offs.tolist()
    starts = [0, *ends[:-1]]
    for j in range(w.shape[0]):
        # even with no rows: the output must reach x and w in autograd on every rank, or a rank whose experts got
        # no token would skip the f's all-reduce in backward that the others run
        a, b = starts[first + j], ends[first + j]
        out[a:b] = torch.mm(x[a:b], w[j])
    return out


def split_experts(gm: fx.GraphModule, placements: dict[str, object], rank: int, tp: int, comm) -> None:
    """Make this rank's graph compute only its experts' rows of every grouped matmul whose bank is placed
    ``EXPERT`` (``placements``: ``get_attr`` target -> placement), with ``f`` before and ``g`` after each chain."""
    for count, (mm, first_of_chain, last_of_chain) in enumerate(expert_matmuls(gm.graph, placements)):
        experts = int(bank_of(mm.args[1]).meta["val"].shape[0])
        first, _ = chunk_span(experts, tp, rank)
        x, w, offs = mm.args[0], mm.args[1], offsets_of(mm)
        mm.target, mm.args, mm.kwargs = local_grouped_mm, (x, w, offs, first), {}
        if first_of_chain:
            name = f"autotp_expert_f_{count}"
            gm.add_submodule(name, CopyToTP(comm))
            with gm.graph.inserting_before(mm):
                mm.args = (gm.graph.call_module(name, (x,)), *mm.args[1:])
        if last_of_chain:
            name = f"autotp_expert_g_{count}"
            gm.add_submodule(name, ReduceFromTP(comm))
            users = list(mm.users)
            with gm.graph.inserting_after(mm):
                summed = gm.graph.call_module(name, (mm,))
            for user in users:
                user.replace_input_with(mm, summed)
    gm.graph.lint()
    gm.recompile()
