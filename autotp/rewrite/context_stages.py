"""Context parallelism inside pipeline stages: each stage graph rewritten to compute its rank's chunks.

A stage graph (``rewrite.stage_graphs``) is a run of the rank graph's nodes under their own names, taking the
previous stage's hidden state as the placeholder ``HIDDEN`` and the model's inputs (so every stage takes the token
ids, reads this rank's positions off them and recomputes masks and rotary tables whole, as the unsharded stage
does). The whole graph's layout restricted to a stage's nodes, with the incoming hidden state standing for the
value it carries, is then that stage's layout: the hidden state crossing a boundary is the rank's chunk (a split
value, carrying its own tokens' whole gradient backward), so no stage gathers it; only the last stage gathers the
model's outputs whole.
"""

from __future__ import annotations

import dataclasses

from torch import fx

from autotp.passes.sequence_split import ContextLayout
from autotp.rewrite.comm import Communicator
from autotp.rewrite.context_graph import apply_context
from autotp.rewrite.stage_graphs import HIDDEN


def stage_layout(layout: ContextLayout, names: set[str], incoming: str | None) -> ContextLayout:
    """``layout`` (of the whole graph) restricted to a stage graph's node ``names``; the stage's ``HIDDEN``
    placeholder stands for ``incoming``, the value the previous stage passes on (None: the first stage)."""
    def own(name: str) -> str:
        return HIDDEN if name == incoming else name

    split = {own(n): d for n, d in layout.split.items() if own(n) in names}
    return dataclasses.replace(
        layout, split=split,
        gathers=[(n, own(a)) for n, a in layout.gathers if n in names],
        selects=[(n, own(a), d) for n, a, d in layout.selects if n in names],
        sizes=[s for s in layout.sizes if s[0] in names],
        causal=[n for n in layout.causal if n in names],
        lengths=[n for n in layout.lengths if n in names],
        exchanges=[n for n in layout.exchanges if n in names],
        kv={(n, own(a)) for n, a in layout.kv if n in names},
        hoisted={n: a for n, a in layout.hoisted.items() if n in names},
        methods={n: m for n, m in layout.methods.items() if n in names})


def apply_context_stage(gm: fx.GraphModule, layout: ContextLayout, comm: Communicator, incoming: str | None,
                        last: bool) -> None:
    """Rewrite the stage graph ``gm`` in place to compute this rank's chunks (``layout``: the whole graph's;
    ``incoming``: the rank-graph value its ``HIDDEN`` placeholder carries, None for the first stage; ``last``:
    whether it returns the model's outputs, which are then gathered whole)."""
    names = {n.name for n in gm.graph.nodes}
    trainable = {n for n, p in gm.named_parameters() if p.requires_grad}
    apply_context(gm, stage_layout(layout, names, incoming), comm, trainable, last)
