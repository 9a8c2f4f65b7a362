"""Find projections (matmuls against a weight parameter) and embedding lookups in a graph.

Found from the ops and their operands, not from module or parameter names: ``nn.Linear`` shows up
as ``aten.linear``, Hugging Face's transposed ``Conv1D`` as ``aten.addmm`` with the weight last, a
mixture-of-experts bank as a grouped matmul against a 3-D ``[experts, in, out]`` weight (each token's
rows multiplied by its expert's matrix), which splits like a plain projection inside every expert.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import fx

from autotp.passes.graph import meta_val

aten = torch.ops.aten


@dataclass(frozen=True)
class Projection:
    """``y = x @ W (+ b)`` with ``W`` a parameter: the unit that is column- or row-split."""

    node: str
    """Name of the matmul node."""
    input: str
    """Name of the node feeding ``x``."""
    weight: str
    """``get_attr`` target of the weight."""
    bias: str | None
    """``get_attr`` target of a fused bias, if any."""
    out_dim: int
    """Storage dim of the weight indexing output features (0 for nn.Linear, 1 for Conv1D)."""
    in_features: int
    out_features: int
    in_dim: int
    """Storage dim of the weight indexing input features (the other of the last two dims)."""
    in_axis: int = -1
    """The dim of the input (counted from the end) that holds the input features: -2 for ``W @ x`` (Mamba's
    time-step projection, ``dt_proj.weight @ dt.transpose(1, 2)``), or the first of several contracted dims
    (``"ibnd,hnd->ibh"``: the heads)."""
    out_axis: int = -1
    """The dim of the output (counted from the end) that holds the output features: -2 for ``W @ x``, or the
    first of several (``"ibh,hnd->ibnd"``: the heads)."""


@dataclass(frozen=True)
class Embedding:
    """``aten.embedding(W, ids)`` with ``W`` a parameter."""

    node: str
    weight: str
    ids: str
    num_embeddings: int


_CASTS = {aten.to.dtype, aten._to_copy.default}


def _attr(node) -> str | None:
    """The ``get_attr`` target if ``node`` reads a module attribute directly, or a cast of it (a router computed
    in float32: ``F.linear(x.float(), W.float())``)."""
    if isinstance(node, fx.Node) and node.op == "call_function" and node.target in _CASTS:
        node = node.args[0]
    return node.target if isinstance(node, fx.Node) and node.op == "get_attr" else None


# op -> (index of x, index of weight, index of bias or None, weight storage dim of output features)
_PROJECTION_OPS = {
    aten.linear.default: (0, 1, 2, 0),
    aten.addmm.default: (1, 2, 0, 1),
    aten.mm.default: (0, 1, None, 1),
    aten.matmul.default: (0, 1, None, 1),
}


def grouped_ops() -> dict:
    """Matmuls against a 3-D ``W [experts, in, out]``: batched (tokens already grouped per expert) and grouped
    (``x [tokens, in]`` with per-expert offsets: torch's, and transformers' fallback, registered only once
    transformers is imported, hence looked up when a graph is searched)."""
    ops = {aten.bmm.default: (0, 1, None, 1)}  # ``x.view(experts, -1, in) @ W``: one matrix per expert
    for namespace, name in (("aten", "_grouped_mm"), ("transformers", "grouped_mm_fallback")):
        packet = getattr(getattr(torch.ops, namespace), name, None) if hasattr(torch.ops, namespace) else None
        if packet is not None:
            ops[packet.default] = (0, 1, None, 1)
    return ops


def _transposed_attr(node) -> str | None:
    """The ``get_attr`` target if ``node`` is a parameter with its last two dims swapped (``W.t()``, as in
    ``x @ W.t()``, or ``W.transpose(-2, -1)`` of a 3-D expert bank)."""
    if not isinstance(node, fx.Node) or node.op != "call_function":
        return None
    n = len(meta_val(node).shape)
    last_two = {n - 2, n - 1}
    swaps = (node.target is aten.t.default or (node.target is aten.numpy_T.default and n == 2)
             or (node.target is aten.transpose.int and {node.args[1] % n, node.args[2] % n} == last_two)
             or (node.target is aten.permute.default and n == 2 and list(node.args[1]) in ([1, 0], [-1, -2])))
    return _attr(node.args[0]) if swaps else None


def _expert_attr(node) -> str | None:
    """The ``get_attr`` target if ``node`` is one expert's matrix of a parameter bank, ``W[e]`` (``select`` along
    the bank's first dim: JetMoE's ``F.linear(x_e, self.weight[e])`` per expert)."""
    if not isinstance(node, fx.Node) or node.target is not aten.select.int or node.args[1] != 0:
        return None
    return _attr(node.args[0])


def _projection(node: fx.Node, specs: dict) -> Projection | None:
    """A Projection if ``node`` multiplies an activation by a parameter (2-D, or 3-D for a grouped matmul)."""
    spec = specs.get(node.target)
    if spec is None or node.kwargs.get("beta", 1) != 1 or node.kwargs.get("alpha", 1) != 1:
        return None
    xi, wi, bi, out_dim = spec
    if len(node.args) <= wi:
        return None
    weight_node = node.args[wi]
    weight = _attr(weight_node)
    ndim = 2 if node.target in _PROJECTION_OPS else 3
    out_dim += ndim - 2
    bank = 0  # the dims before the matrix in the parameter's storage: one for an expert's matrix of a bank
    if weight is None and ndim == 2 and _expert_attr(weight_node) is not None:
        weight, bank = _expert_attr(weight_node), 1
    if weight is None and _transposed_attr(weight_node) is not None:
        # x @ W.t(): the parameter's output features sit on the other storage dim.
        weight, out_dim, weight_node = _transposed_attr(weight_node), 2 * ndim - 3 - out_dim, weight_node.args[0]
    x = node.args[xi]
    if weight is None or not isinstance(x, fx.Node) or _attr(x) is not None:
        return None
    shape = meta_val(weight_node).shape
    if len(shape) != ndim:
        return None
    in_dim = 2 * ndim - 3 - out_dim
    bias_node = node.args[bi] if bi is not None and len(node.args) > bi else None
    bias = _attr(bias_node)
    if bias_node is not None and bias is None:
        return None  # a computed bias: leave the op alone
    return Projection(node=node.name, input=x.name, weight=weight, bias=bias, out_dim=out_dim + bank,
                      in_features=int(shape[in_dim]), out_features=int(shape[out_dim]), in_dim=in_dim + bank)


def _left_projection(node: fx.Node) -> Projection | None:
    """A Projection if ``node`` is ``W @ x`` with ``W`` a 2-D parameter (or its transpose) and ``x`` at least 2-D."""
    if node.target is not aten.matmul.default or len(node.args) < 2 or not isinstance(node.args[1], fx.Node):
        return None
    weight_node, x = node.args
    weight, out_dim = _attr(weight_node), 0
    if weight is None and _transposed_attr(weight_node) is not None:
        weight, out_dim, weight_node = _transposed_attr(weight_node), 1, weight_node.args[0]
    if weight is None or _attr(x) is not None or len(meta_val(weight_node).shape) != 2 or len(meta_val(x).shape) < 2:
        return None
    shape = meta_val(weight_node).shape
    return Projection(node=node.name, input=x.name, weight=weight, bias=None, out_dim=out_dim,
                      in_features=int(shape[1 - out_dim]), out_features=int(shape[out_dim]), in_dim=1 - out_dim,
                      in_axis=-2, out_axis=-2)


def _einsum_projection(node: fx.Node) -> Projection | None:
    """A Projection if ``node`` is an einsum that is ``x @ W`` with ``W`` a parameter: x's trailing indices
    contracted with some of W's, W's other indices last in the output, x's others kept in order before them
    (``"btf,fd->btd"``; a parameter with a dim per head, as XLNet's ``"ibh,hnd->ibnd"`` and ``"ibnd,hnd->ibh"``).
    The features split are the first contracted index and the first of W's output indices: a contraction
    over a slice of one of them is a partial sum, and a slice of one of them slices the output alike."""
    if node.target is not aten.einsum.default or len(node.args) != 2 or len(node.args[1]) != 2:
        return None
    x, weight_node = node.args[1]
    weight = _attr(weight_node)
    if weight is None or not isinstance(x, fx.Node) or _attr(x) is not None or "->" not in node.args[0]:
        return None
    inputs, out = node.args[0].replace(" ", "").split("->")
    xs, ws = inputs.split(",")
    if "." in xs + ws or len(xs) != len(meta_val(x).shape) or len(set(xs)) != len(xs) or len(set(ws)) != len(ws):
        return None
    contracted = [i for i in xs if i in ws]
    kept = [i for i in ws if i not in xs]
    batch = xs[:len(xs) - len(contracted)]
    if (not contracted or not kept or xs[len(batch):] != "".join(contracted) or out != batch + "".join(kept)
            or len(contracted) + len(kept) != len(ws)):
        return None
    shape = meta_val(weight_node).shape
    in_dim, out_dim = ws.index(contracted[0]), ws.index(kept[0])
    return Projection(node=node.name, input=x.name, weight=weight, bias=None, out_dim=out_dim,
                      in_features=int(shape[in_dim]), out_features=int(shape[out_dim]), in_dim=in_dim,
                      in_axis=-len(contracted), out_axis=-len(kept))


def find_projections(graph: fx.Graph) -> dict[str, Projection]:
    """Every projection in ``graph``, keyed by node name, in graph order."""
    specs = _PROJECTION_OPS | grouped_ops()
    found = (_projection(n, specs) or _left_projection(n) or _einsum_projection(n)
             for n in graph.nodes if n.op == "call_function")
    return {p.node: p for p in found if p is not None}


def find_embeddings(graph: fx.Graph) -> dict[str, Embedding]:
    """Every embedding lookup of a parameter table, keyed by node name."""
    out = {}
    for node in graph.find_nodes(op="call_function", target=aten.embedding.default):
        weight = _attr(node.args[0])
        if weight is not None and isinstance(node.args[1], fx.Node):
            out[node.name] = Embedding(node=node.name, weight=weight, ids=node.args[1].name,
                                       num_embeddings=int(meta_val(node.args[0]).shape[0]))
    return out
