"""Projections autotp keeps whole on purpose, and why: where splitting costs more than it saves, as Megatron
also judges (a transform right before the vocabulary head, a mixture-of-experts router)."""

from __future__ import annotations

import torch
from autotp.passes.graph import arg_or_default, sizes
from autotp.passes.projections import CONVOLUTIONS, Projection
from autotp.passes.reshapes import static
from autotp.passes.vocab import feeds_only_heads
from torch import fx

aten = torch.ops.aten

HEAD_TRANSFORM = ("a transform before the vocabulary head, which needs its output whole; splitting it would add "
                  "an all-gather and an all-reduce of its output per step (Megatron keeps it whole too)")
ROUTER = ("a mixture-of-experts router: its logits feed a top-k over all experts, so a split would be gathered "
          "again at once (Megatron keeps routers whole too)")

_ROUTING = {aten.topk.default}
_ROUTER_DEPTH = 6
"""How many ops (a softmax, a cast, a bias add) may lie between a router and its top-k."""


def routes(node: fx.Node) -> bool:
    """Whether ``node``'s output reaches, within a few ops, a top-k among a fixed number of choices: a router's
    logits. A top-k along the sequence (a sparse-attention indexer picking keys) is not routing."""
    frontier = [node]
    for _ in range(_ROUTER_DEPTH):
        frontier = [u for n in frontier for u in n.users]
        if any(u.target in _ROUTING and _among_constant(u) for u in frontier):
            return True
    return False


def _among_constant(topk: fx.Node) -> bool:
    """Whether a top-k chooses along a dim of constant size (experts, groups), not a dynamic one (positions)."""
    return static(sizes(topk.args[0])[arg_or_default(topk, 2, "dim", -1)]) is not None


def kept_by_choice(node: fx.Node, projections: dict[str, Projection], heads: tuple[str, ...],
                   adapter_adds: frozenset = frozenset(), adapter_reads: frozenset = frozenset()) -> str | None:
    """Why the projection ``node`` is kept whole on purpose, or None when it should be split if it can
    (``adapter_adds``: where LoRA adapters' outputs join their bases'; ``adapter_reads``: the nodes by which the
    heads' adapters read the heads' input; ``vocab.feeds_only_heads``)."""
    if heads and feeds_only_heads(node, projections, heads, adapter_adds, adapter_reads):
        return HEAD_TRANSFORM
    if routes(node):
        return ROUTER
    return None


_CONVOLUTIONS = {*CONVOLUTIONS, aten.conv_transpose1d.default, aten.conv_transpose2d.input}


def whole_convolutions(graph: fx.Graph, split_targets: set[str]) -> list[tuple[fx.Node, str]]:
    """The convolutions whose weight stays whole (patch embeddings, audio front ends, any that no exact split
    reaches): (node, weight target: the parameter the weight is or is computed from), for a plan note. A dense
    convolution is split as a projection of its channels, a grouped one with its channels split
    (``rules_channels``); transposed ones never are."""
    out = []
    for node in graph.nodes:
        if node.op != "call_function" or node.target not in _CONVOLUTIONS:
            continue
        weight = convolution_weight(node)
        if weight is not None and weight.target not in split_targets:
            out.append((node, weight.target))
    return out


_WEIGHT_DEPTH = 8
"""How many ops may lie between a convolution's weight and the parameter it is computed from (a weight
standardisation is three, a weight normalisation written out five)."""


def convolution_weight(conv: fx.Node, among: set[str] | None = None) -> fx.Node | None:
    """The ``get_attr`` a convolution's weight is, or the one of its shape it is computed from within
    ``_WEIGHT_DEPTH`` ops (weight standardisation, weight normalisation: ops on parameters only), among the
    targets ``among`` (any, if None); None if it is computed from the inputs."""
    weight = conv.args[1]
    if not isinstance(weight, fx.Node):
        return None
    shape, frontier, seen = sizes(weight), [weight], set()
    for _ in range(_WEIGHT_DEPTH):
        found = [n for n in frontier if n.op == "get_attr" and (among is None or n.target in among)
                 and sizes(n) == shape]
        if found:
            return found[0]
        if any(n.op == "placeholder" for n in frontier):
            return None  # the weight depends on the inputs: not a parameter
        frontier = [a for n in frontier for a in n.all_input_nodes if a not in seen and not seen.add(a)]
    return None
