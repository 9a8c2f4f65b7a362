"""How each attention exchanges keys and values across the cp ranks: what each method costs (``exchange_cost``:
bytes a rank receives per training step, messages, bytes it holds), which methods an attention can take
(``applicable``), and the choice (``choose_exchange``); ``exchange_methods`` records it per attention of a layout.

- all-gather: every rank gathers the whole K and V (KV heads) forward and reduce-scatters their gradients
  backward, ``2 x 2 x (cp-1)/cp`` of one whole K: the fewest bytes, but each rank holds (and saves for backward)
  K and V whole, repeated to the query heads where the attention repeats them.
- ring: K/V blocks passed ``cp - 1`` times forward, again backward with their gradients travelling home
  (``3 x (cp-1)`` blocks of K and V): half as many bytes again, ``3 (cp-1)`` messages, but a rank holds its own
  block and one in flight.
- Ulysses: four all-to-alls forward (Q, K, V, the output) and four backward, each moving ``(cp-1)/cp`` of this
  rank's tensor; holds every token of ``1/cp`` of the heads (about a block's worth); needs cp to divide the KV heads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import fx

from autotp.options import ContextExchange
from autotp.passes.graph import SHAPE_META
from autotp.passes.sequence_split import SDPA, ContextLayout

HOLD_LIMIT = 2 ** 30
"""Bytes of keys and values (all attentions together) a rank may hold whole before ``auto`` leaves the
all-gather for a method holding about ``1/cp`` of them, where no ``memory_budget`` says otherwise; with one,
a quarter of it (the rest is for weights, gradients, optimizer state and the other activations)."""

BANDWIDTH, LATENCY = 6e8, 1e-3
"""The link ``auto`` prices on when no machine is given: bytes/s and seconds per message (gloo on CPU,
``planning.machines.CPU``); the choice turns on their ratio, not on the machine."""


@dataclass(frozen=True)
class AttentionShape:
    """What an attention's exchange costs depend on (per rank's batch): batch, whole sequence, query heads, KV
    heads, head dim, bytes per element."""

    batch: int
    seq: int
    heads: int
    kv_heads: int
    head_dim: int
    itemsize: int = 4
    masked: bool = False
    """Whether the attention takes a mask (Ulysses reads it whole: SDPA keeps it as ``[B, 1, T, T]`` floats)."""


@dataclass(frozen=True)
class ExchangeCost:
    """One attention's exchange by ``method`` on one rank per training step (forward and backward)."""

    method: str
    received: int
    """Bytes the rank receives."""
    messages: int
    """Transfers in sequence (each costs the link's latency)."""
    held: int
    """Bytes of keys and values (and queries and outputs, for Ulysses) the rank holds at once for it."""

    def seconds(self, bandwidth: float = BANDWIDTH, latency: float = LATENCY) -> float:
        """Time on a link of ``bandwidth`` bytes/s and ``latency`` seconds per message."""
        return self.received / bandwidth + self.messages * latency


def exchange_cost(method: ContextExchange | str, shape: AttentionShape, cp: int) -> ExchangeCost:
    """What ``method`` costs one rank for one attention of ``shape`` at ``cp`` ranks (module docstring)."""
    method = ContextExchange(method)
    s = shape
    block = s.batch * (s.seq // cp) * s.head_dim * s.itemsize  # one head of this rank's tokens
    if method is ContextExchange.ALL_GATHER:
        repeated = s.heads if s.heads != s.kv_heads else 0
        held = 2 * s.batch * s.seq * s.head_dim * s.itemsize * (s.kv_heads + repeated)
        return ExchangeCost(method.value, 2 * 2 * s.kv_heads * block * (cp - 1), 2, held)
    if method is ContextExchange.RING:
        return ExchangeCost(method.value, 3 * 2 * s.kv_heads * block * (cp - 1), 3 * (cp - 1),
                            2 * 2 * s.kv_heads * block)
    moved = 2 * (s.heads + s.kv_heads) * block * (cp - 1) // cp  # Q, K, V there, the output back
    mask = s.batch * s.seq * s.seq * 4 if s.masked else 0
    return ExchangeCost(method.value, 2 * moved, 8, 2 * (s.heads + s.kv_heads) * block + mask)


def applicable(method: ContextExchange, shape: AttentionShape | None, cp: int) -> str | None:
    """Why ``method`` cannot take an attention of ``shape`` (None: ``attention_shape`` found no SDPA or explicit
    ``softmax(QK^T)V`` over ``[B, heads, T, D]`` operands there), or None when it can."""
    if method is ContextExchange.ALL_GATHER:
        return None
    if shape is None:
        return ("not an SDPA or softmax(QK^T * scale + mask)V over [batch, heads, sequence, head dim] operands with a "
                "mask read by query rows (casts that change the dtype, dropout p > 0, a masked_fill by a finite "
                "value and probabilities read elsewhere are not taken)")
    if method is ContextExchange.ULYSSES and shape.kv_heads % cp:
        return f"cp={cp} does not divide its {shape.kv_heads} KV heads"
    return None


def choose_exchange(shapes: list[AttentionShape | None], cp: int, memory_budget: int | None = None) -> list[str]:
    """``auto``'s method for each attention: the all-gather (fewest bytes) while every attention's keys and values
    held whole fit ``HOLD_LIMIT`` (a quarter of ``memory_budget`` when given); beyond, for each attention, the
    fastest of ring and Ulysses (where cp divides the KV heads) among those whose holdings, over all attentions,
    fit that limit (the one holding least if neither does: Ulysses holds a mask whole)."""
    limit = memory_budget // 4 if memory_budget else HOLD_LIMIT
    whole = sum(exchange_cost(ContextExchange.ALL_GATHER, s, cp).held for s in shapes if s is not None)
    out = []
    for shape in shapes:
        if shape is None or whole <= limit:
            out.append(ContextExchange.ALL_GATHER.value)
            continue
        light = [exchange_cost(m, shape, cp) for m in (ContextExchange.RING, ContextExchange.ULYSSES)
                 if applicable(m, shape, cp) is None]
        fit = [c for c in light if c.held * len(shapes) <= limit]
        out.append(min(fit, key=ExchangeCost.seconds).method if fit else min(light, key=lambda c: c.held).method)
    return out


def attention_shape(graph: fx.Graph, layout: ContextLayout, name: str, batch: int | None = None,
                    seq: int | None = None) -> AttentionShape | None:
    """The shape of attention ``name`` of ``layout`` (sizes at ``batch`` x ``seq``, default the captured
    example's), or None when a ring or Ulysses exchange cannot take it: neither an SDPA nor an explicit
    ``softmax(QK^T)V`` (``passes.attention_chains``), operands not
    ``[B, heads, T, D]`` split along T, or a mask split along the sequence or without a key per position."""
    nodes = {n.name: n for n in graph.nodes}
    node = nodes[name]
    if name in layout.explicit:
        e = layout.explicit[name]
        q, k, v = nodes[e.q], nodes[e.k], nodes[e.v]
        mask = nodes[e.mask_op].args[e.mask_arg] if e.mask_op is not None else None
    elif node.target is SDPA:
        q, k, v = (_source(nodes, layout, a) for a in node.args[:3])
        mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
    else:
        return None
    if any(x is None or len(_shape(x)) != 4 or layout.split.get(x.name) != 2 for x in (q, k, v)):
        return None
    if isinstance(mask, fx.Node) and (mask.name in layout.split or str(_shape(mask)[-1]) != str(layout.seq)):
        return None
    (b, h, _, d), kv_heads = _shape(q), _shape(k)[1]
    if not all(isinstance(x, int) for x in (h, d, kv_heads)) or h % kv_heads or _shape(v)[1] != kv_heads:
        return None
    batch = batch or (b if isinstance(b, int) else 1)
    val = q.meta.get("val")
    itemsize = val.element_size() if isinstance(val, torch.Tensor) else 4
    return AttentionShape(batch, seq or _example_length(q), h, kv_heads, d, itemsize, isinstance(mask, fx.Node))


def kv_source(nodes: dict, layout: ContextLayout, value: fx.Node) -> fx.Node:
    """The node whose keys (or values) a ring or Ulysses exchange moves: before ``repeat_kv`` where the
    attention repeats them."""
    while value.name in layout.hoisted:
        value = value.args[0]
    return value


def _source(nodes, layout, value):
    return kv_source(nodes, layout, value) if isinstance(value, fx.Node) else None


def _shape(node: fx.Node) -> tuple:
    recorded = node.meta.get(SHAPE_META)
    if recorded is not None:
        return tuple(recorded)
    val = node.meta.get("val")
    return tuple(val.shape) if isinstance(val, torch.Tensor) else ()


def _example_length(node: fx.Node) -> int:
    val = node.meta.get("val")
    return int(val.shape[2]) if isinstance(val, torch.Tensor) else 1


def exchange_methods(graph: fx.Graph, layout: ContextLayout, cp: int, method: ContextExchange | str,
                     memory_budget: int | None = None) -> tuple[dict[str, str], list[str]]:
    """Each attention's exchange in ``layout`` under the ``cp_exchange`` setting ``method``, and the notes on
    attentions that fall back to all-gather (naming why)."""
    method = ContextExchange(method)
    shapes = [attention_shape(graph, layout, name) for name in layout.exchanges]
    if method is ContextExchange.AUTO:
        chosen = choose_exchange(shapes, cp, memory_budget)
        return dict(zip(layout.exchanges, chosen)), []
    out, notes = {}, []
    for name, shape in zip(layout.exchanges, shapes):
        why = applicable(method, shape, cp)
        out[name] = method.value if why is None else ContextExchange.ALL_GATHER.value
        if why is not None:
            notes.append(f"cp: {name} falls back to all-gather ({method.value} cannot take it: {why})")
    return out, notes
