"""Find projections (matmuls against a weight parameter) and embedding lookups in a graph.

Found from the ops and their operands, not from module or parameter names: ``nn.Linear`` shows up
as ``aten.linear``, Hugging Face's transposed ``Conv1D`` as ``aten.addmm`` with the weight last, a
mixture-of-experts bank as a grouped matmul against a 3-D ``[experts, in, out]`` weight (each token's
rows multiplied by its expert's matrix), which splits like a plain projection inside every expert, a dense
convolution (one group) as a projection of its channels at every position (features on dim 1).
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
    left: bool = False
    """``W @ x``: the weight multiplies from the left, so features run along the second-last dim of ``x`` and of
    the output (Mamba's time-step projection, ``dt_proj.weight @ dt.transpose(1, 2)``)."""
    spatial: int = 0
    """A dense convolution over this many trailing spatial dims (``N, C, *spatial``): a projection of the
    channels at every position, so its features are dim 1 (weight ``[out, in, *kernel]``)."""

    @property
    def feature_axis(self) -> int:
        """The dim of the input and output (counted from the end) that holds the features."""
        return -2 if self.left else -1 - self.spatial


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
    return Projection(node=node.name, input=x.name, weight=weight, bias=bias, out_dim=out_dim,
                      in_features=int(shape[in_dim]), out_features=int(shape[out_dim]), in_dim=in_dim)


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
                      left=True)


def _einsum_projection(node: fx.Node) -> Projection | None:
    """A Projection if ``node`` is an einsum that is ``x @ W`` (or ``x @ W.T``) with ``W`` a 2-D parameter: x's
    last index contracted with one of W's, W's other index last in the output, x's others kept in order
    (``"btf,fd->btd"``)."""
    if node.target is not aten.einsum.default or len(node.args) != 2 or len(node.args[1]) != 2:
        return None
    x, weight_node = node.args[1]
    weight = _attr(weight_node)
    if weight is None or not isinstance(x, fx.Node) or _attr(x) is not None or "->" not in node.args[0]:
        return None
    inputs, out = node.args[0].replace(" ", "").split("->")
    xs, ws = inputs.split(",")
    if len(ws) != 2 or len(xs) != len(meta_val(x).shape) or "." in xs or len(set(xs + ws)) != len(xs) + 1:
        return None
    if xs[-1] not in ws or out != xs[:-1] + ws.replace(xs[-1], ""):
        return None
    shape = meta_val(weight_node).shape
    in_dim = ws.index(xs[-1])
    return Projection(node=node.name, input=x.name, weight=weight, bias=None, out_dim=1 - in_dim,
                      in_features=int(shape[in_dim]), out_features=int(shape[1 - in_dim]), in_dim=in_dim)


# op -> index of ``groups`` (a convolution's; ``aten.convolution`` also says whether it is transposed, at 6)
CONVOLUTIONS = {aten.conv1d.default: 6, aten.conv2d.default: 6, aten.conv3d.default: 6,
                aten.convolution.default: 8}


def conv_groups(node: fx.Node) -> int:
    """The ``groups`` of a convolution node (1 when not given)."""
    index = CONVOLUTIONS[node.target]
    return node.args[index] if len(node.args) > index else node.kwargs.get("groups", 1)


def _conv_projection(node: fx.Node) -> Projection | None:
    """A Projection if ``node`` is a dense (one group, not transposed) convolution of a batched activation by a
    parameter: column-split, it slices the weight's output channels; row-split, its input channels, the
    partial sums all-reduced. Grouped convolutions are split with their channels by their own rule."""
    if node.target not in CONVOLUTIONS or conv_groups(node) != 1 or len(node.args) < 2 or "bias" in node.kwargs:
        return None
    if node.target is aten.convolution.default and node.args[6]:
        return None
    x, weight_node = node.args[0], node.args[1]
    weight = _attr(weight_node)
    if weight is None or not isinstance(x, fx.Node) or _attr(x) is not None:
        return None
    shape = meta_val(weight_node).shape
    if len(meta_val(x).shape) != len(shape):
        return None  # an unbatched input (``C, L``): its channels are dim 0
    bias_node = node.args[2] if len(node.args) > 2 else None
    bias = _attr(bias_node)
    if bias_node is not None and bias is None:
        return None
    return Projection(node=node.name, input=x.name, weight=weight, bias=bias, out_dim=0, in_dim=1,
                      in_features=int(shape[1]), out_features=int(shape[0]), spatial=len(shape) - 2)


def find_projections(graph: fx.Graph) -> dict[str, Projection]:
    """Every projection in ``graph``, keyed by node name, in graph order."""
    specs = _PROJECTION_OPS | grouped_ops()
    found = (_projection(n, specs) or _left_projection(n) or _einsum_projection(n) or _conv_projection(n)
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
