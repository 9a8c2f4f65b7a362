"""Context parallelism at plan time: the graph's layout split along the sequence (``passes.sequence_split``), refused
with the op's name where it cannot be, and the notes the plan carries about it."""

from __future__ import annotations

import torch
from torch import fx

from autotp.capture import Captured
from autotp.errors import PlanError
from autotp.passes.sequence_split import ContextLayout, context_layout
from autotp.passes.costs import tensor_bytes
from autotp.passes.graph import SHAPE_META
from autotp.planning.context_exchange import exchange_methods

aten = torch.ops.aten
_PASSING = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.clone.default,
            aten.contiguous.default, aten.to.dtype, aten._to_copy.default, aten.alias.default}


def token_inputs(captured: Captured) -> tuple[object, dict[str, int]]:
    """(the sequence length as a sympy symbol, the token-id placeholders an embedding reads -> their sequence
    dim); PlanError when no embedding reads input ids of a dynamic length."""
    analysis = captured.analysis
    sequence = sorted(analysis.sequence_sizes, key=str)
    if len(sequence) != 1:
        raise PlanError("cp splits the sequence of the token ids an embedding looks up, but this model has "
                        f"{'none with a dynamic sequence length' if not sequence else 'several lengths'}; "
                        "leave cp at 1 for this model")
    seq = sequence[0]
    inputs = {}
    for emb in analysis.embeddings.values():
        ids = _source(analysis.nodes[emb.ids])
        if ids is not None:
            inputs[ids.name] = max(d for d, size in enumerate(ids.meta[SHAPE_META]) if size == seq)
    if not inputs:
        raise PlanError("cp splits the token ids an embedding looks up, but no embedding reads a model input; "
                        "leave cp at 1 for this model")
    return seq, inputs


def _source(node):
    """The model input ``node`` is (through reshapes and copies: GPT-2 views its ids ``(-1, T)``), or None."""
    while node.op == "call_function" and node.target in _PASSING and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    return node if node.op == "placeholder" and any(
        not isinstance(s, int) for s in node.meta.get(SHAPE_META, ())) else None


def plan_context(captured: Captured, cp: int, exchange: str = "auto",
                 memory_budget: int | None = None) -> ContextLayout:
    """The context-parallel layout of ``captured`` at ``cp`` ranks, each attention's exchange chosen under the
    ``cp_exchange`` setting ``exchange`` (``planning.context_exchange``); PlanError naming each op that cannot be
    split along the sequence."""
    seq, inputs = token_inputs(captured)
    layout = context_layout(captured.module.graph, seq, inputs)
    if layout.refused:
        raise PlanError(f"cp={cp} cannot split this model along the sequence: " + "; ".join(layout.refused))
    layout.methods, layout.fallbacks = exchange_methods(captured.module.graph, layout, cp, exchange, memory_budget)
    return layout


def context_notes(layout: ContextLayout, cp: int) -> tuple[str, ...]:
    """What the plan says about its context parallelism."""
    notes = [f"cp={cp}: every rank holds 2 of {2 * cp} sequence chunks (load-balanced for causal attention); "
             + _exchange_note(layout),
             "cp: pm.generate is refused (decoding from a sequence-split cache is not implemented); generate with "
             "a cp=1 module"]
    notes.extend(layout.fallbacks)
    if layout.crossing:
        notes.append(f"cp: {len(layout.crossing)} op(s) read across positions and take their inputs gathered whole "
                     f"(exact, communicated): {', '.join(layout.crossing[:6])}"
                     + (" ..." if len(layout.crossing) > 6 else ""))
    return tuple(notes)


def exchanged_kv(captured: Captured, sizes: dict[str, int], unit_of: dict[str, int], units: int,
                 tp: int) -> tuple[tuple[float, ...], int]:
    """(bytes of the keys and values each unit's attention gathers under cp, at ``sizes`` and one of ``tp`` ranks'
    heads; the sequence length at ``sizes``) for the layout search; ((), 0) where the model cannot run
    context-parallel (it is then not offered)."""
    try:
        seq, inputs = token_inputs(captured)
        layout = context_layout(captured.module.graph, seq, inputs)
    except PlanError:
        return (), 0
    if layout.refused or not layout.kv:
        return (), 0
    nodes, kv = captured.analysis.nodes, [0.0] * units
    for _, arg in sorted(layout.kv):
        kv[unit_of.get(arg, 0)] += tensor_bytes(nodes[arg], sizes) / tp
    return tuple(kv), int(sizes.get(str(seq), 0))


def _exchange_note(layout: ContextLayout) -> str:
    """How the attentions exchange: each ring or Ulysses attention by name, the all-gathers counted."""
    gathered = [n for n in layout.exchanges if layout.methods.get(n, "all_gather") == "all_gather"]
    others = [f"{n} by {layout.methods[n]}" for n in layout.exchanges if n not in gathered]
    notes = [f"attention exchanges keys and values: {', '.join(others)}"] if others else []
    if gathered or not others:
        notes.append(f"{len(gathered)} attention product(s) all-gather their keys or values (reduce-scatter of "
                     "their gradients)")
    return "; ".join(notes)
