"""The mixture-of-experts layers of a captured model as the layout search prices them (``expert_cost.MoeLayer``):
found from their routers (``passes.routed_experts``), with the routed experts' parameters read from the model's
structure, not from per-model names.

A layer's routed experts are the parameters under its module that hold one matrix per expert: a bank whose first
dim is the layer's experts (``[E, out, in]``, as grouped matmuls and per-expert indexing read), or a child list of
exactly ``E`` modules (a loop over ``nn.ModuleList`` experts). The router's own weight (``[E, hidden]``) is not an
expert, nor is a shared expert beside them.
"""

from __future__ import annotations

import math
import re

from autotp.passes.routed_experts import ExpertLayer, expert_layers
from autotp.planning.expert_cost import MoeLayer


def _list_children(names: list[str], prefix: str, experts: int) -> set[str]:
    """The parameter names in a child list of exactly ``experts`` modules under ``prefix`` (``prefix.experts.3.w1``)."""
    by_child: dict[str, set[int]] = {}
    pattern = re.compile(re.escape(prefix) + r"([^.]+)\.(\d+)\.")
    for name in names:
        if found := pattern.match(name):
            by_child.setdefault(found.group(1), set()).add(int(found.group(2)))
    lists = {child for child, indices in by_child.items() if indices == set(range(experts))}
    return {n for n in names if (found := pattern.match(n)) and found.group(1) in lists}


def routed_params(params: dict[str, tuple[int, ...]], layer: ExpertLayer) -> dict[str, tuple[int, ...]]:
    """The routed experts' parameters of ``layer`` among ``params`` (name -> shape)."""
    prefix = layer.module + "."
    own = {n: s for n, s in params.items() if n.startswith(prefix) and not n.startswith(layer.router + ".")}
    listed = _list_children(list(own), prefix, layer.experts)
    return {n: s for n, s in own.items() if n in listed or (len(s) >= 2 and s[0] == layer.experts)}


def _width(shapes: dict[str, tuple[int, ...]], listed: set[str]) -> int:
    """The smallest dim of one expert's matrices (a bank's first dim, its experts, left out; biases too)."""
    matrices = [s if n in listed else s[1:] for n, s in shapes.items()]
    dims = [d for m in matrices if len(m) >= 2 for d in m]
    return min(dims) if dims else 1


def moe_layers(analysis, params: dict[str, tuple[int, ...]], unit_of_layer: dict[str, int], rank_elements: dict[str, float],
               tokens: float) -> tuple[MoeLayer, ...]:
    """The mixture-of-experts layers of ``analysis`` (its parameters' shapes ``params``, by original name) for the
    layout search: each at the
    unit of its router (``unit_of_layer``: a layer's readable name -> unit), with its routed experts' elements
    whole and per tensor-parallel rank (``rank_elements``: parameter name -> elements one rank holds), for a global
    batch of ``tokens`` tokens."""
    out = []
    for layer in expert_layers(analysis):
        routed = routed_params(params, layer)
        if not routed:
            continue
        listed = _list_children(list(routed), layer.module + ".", layer.experts)
        router = params.get(layer.router + ".weight")
        hidden = router[-1] if router else min(s[-1] for s in routed.values())
        whole = sum(math.prod(s) for s in routed.values())
        out.append(MoeLayer(unit_of_layer.get(layer.router, 0), layer.experts, max(layer.top_k, 1), int(hidden),
                            _width(routed, listed), float(whole),
                            float(sum(rank_elements.get(n, math.prod(s)) for n, s in routed.items())), tokens))
    return tuple(out)
