"""One all-reduce for a vocabulary-split embedding and its low-rank adapters (``passes.embedding_adapters``).

Each rank's base lookup ``E_j[ids]`` and adapter lookup ``A_j.T[ids]`` are partial sums (zeros where the token is
another rank's). Their sums are independent, so one all-reduce of the two side by side (``cat`` on the features,
``dim + r`` wide) gives both: the rank-r lookup whole on every rank, to which the whole ``B`` applies locally. The
reduction's backward is the identity, so the gradient of the side-by-side value is sliced back into each lookup's.
"""

from __future__ import annotations

import torch
from torch import fx, nn

from autotp.passes.analysis import Analysis
from autotp.passes.graph import meta_val
from autotp.rewrite.graph_edit import STANDS_FOR, move_before

aten = torch.ops.aten


def reduce_joined(base: fx.Node, lookups: list[fx.Node], analysis: Analysis, reduction: nn.Module,
                  add_module) -> None:
    """Reduce ``base`` (a masked lookup) and ``lookups`` (its adapters' masked lookups) with one ``reduction``
    module (``add_module(module)`` names it in the graph module), each reader then reading its slice of the sum."""
    graph = base.graph
    for lookup in lookups:
        move_before(lookup, base)
    parts = [base, *lookups]
    readers = {part: list(part.users) for part in parts}
    with graph.inserting_after(base):
        joined = graph.call_function(aten.cat.default, (parts, -1))
    with graph.inserting_after(joined):
        summed = graph.call_module(add_module(reduction), (joined,))
    start, at = 0, summed
    for part in parts:
        width = int(meta_val(analysis.nodes[part.name]).shape[-1])
        with graph.inserting_after(at):
            at = graph.call_function(aten.slice.Tensor, (summed, -1, start, start + width))
        at.meta[STANDS_FOR] = part.name
        start += width
        for user in readers[part]:
            user.replace_input_with(part, at)
