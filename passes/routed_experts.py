"""The mixture-of-experts layers of a graph, found from their routers: a projection whose logits reach a top-k
over a fixed number of choices (``choices.routes``). Each layer is named by the module holding its router
(``model.layers.0.mlp`` for ``model.layers.0.mlp.gate``) and counts its routed experts (the choices of the widest
top-k the router reaches: a group-limited router, as DeepSeek-V3's, first picks among groups) and the experts
each token is sent to (that top-k's k). Read-only: what expert parallelism would divide among ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import fx

from autotp.passes.choices import ROUTER, routes
from autotp.passes.graph import arg_or_default, sizes
from autotp.passes.reshapes import static

aten = torch.ops.aten

_ROUTER_DEPTH = 8
"""How many ops may lie between a router and the top-k that picks its experts (a group-limited router's masking
of the groups not picked lies between them)."""


@dataclass(frozen=True)
class ExpertLayer:
    """One mixture-of-experts layer of a graph."""

    module: str
    """The module holding the router (the layer: ``model.layers.0.mlp``)."""
    router: str
    """The router's readable name (``model.layers.0.mlp.gate``)."""
    experts: int
    """Routed experts (the choices of the top-k that picks them)."""
    top_k: int
    """Experts each token is routed to."""

    def owns(self, name: str) -> bool:
        """Whether the parameter (or module) ``name`` belongs to this layer: it lies in the layer's module, or in the
        module holding that (a router that is a module of its own: DBRX's ``ffn.router`` beside ``ffn.experts``)."""
        outer = self.module.rpartition(".")[0]
        return name.startswith(self.module + ".") or (bool(outer) and name.startswith(outer + "."))


def _topks(router: fx.Node) -> list[fx.Node]:
    """The top-ks over a fixed number of choices within ``_ROUTER_DEPTH`` ops after ``router``."""
    found, frontier, seen = [], [router], {router}
    for _ in range(_ROUTER_DEPTH):
        frontier = [u for n in frontier for u in n.users if u not in seen and not seen.add(u)]
        found += [u for u in frontier if u.target is aten.topk.default and _choices(u) is not None]
    return found


def _choices(topk: fx.Node) -> int | None:
    return static(sizes(topk.args[0])[arg_or_default(topk, 2, "dim", -1)])


def expert_layer(router: fx.Node, router_name: str, module: str) -> ExpertLayer | None:
    """The layer ``router`` (a projection whose logits route tokens) chooses experts for, or None when no top-k
    over a fixed number of choices follows it closely."""
    topks = _topks(router)
    if not topks:
        return None
    widest = max(topks, key=_choices)
    k = arg_or_default(widest, 1, "k", 1)
    parent = module.rpartition(".")[0] if module else ""
    return ExpertLayer(parent or module, router_name, int(_choices(widest)), int(k) if isinstance(k, int) else 0)


def expert_layers(analysis) -> tuple[ExpertLayer, ...]:
    """Every mixture-of-experts layer of ``analysis``'s graph (a ``passes.analysis.Analysis``), in graph order:
    one per router the planner keeps whole as a router."""
    out: dict[str, ExpertLayer] = {}
    for name, why in analysis.chosen_whole.items():
        node = analysis.nodes[name]
        if why != ROUTER or not routes(node):
            continue
        layer = expert_layer(node, analysis.layer(name), analysis.module(name))
        if layer is not None:
            out.setdefault(layer.module, layer)
    order = {n.name: i for i, n in enumerate(analysis.graph.nodes)}
    routers = {analysis.layer(n): order[n] for n in analysis.chosen_whole}
    return tuple(sorted(out.values(), key=lambda layer: routers.get(layer.router, 0)))
