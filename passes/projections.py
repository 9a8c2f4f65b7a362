"""Find projections (matmuls against a weight parameter) and embedding lookups in a graph.

Found from the ops and their operands, not from module or parameter names: ``nn.Linear`` shows up
as ``aten.linear``, Hugging Face's transposed ``Conv1D`` as ``aten.addmm`` with the weight last, a
mixture-of-experts bank as a grouped matmul against a 3-D ``[experts, in, out]`` weight (each token's
rows multiplied by its expert's matrix), which splits like a plain projection inside every expert, a dense
convolution (one group) as a projection of its channels at every position (features on dim 1).
"""

from __future__ import annotations

import dataclasses
import operator
from dataclasses import dataclass

import torch
from torch import fx

from autotp.passes.expert_banks import expert_attr, folded_expert
from autotp.passes.graph import arg_or_default, meta_val, param_attr

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
    packed: tuple[int, int, int] | None = None
    """(start, length, the parameter's size) along ``out_dim`` when the weight is a slice of a packed parameter
    (cross-attention's ``w_q, w_kv = in_proj_weight.split([E, 2 * E])``): a projection on that segment, the
    parameter split as a whole with every segment's own split side by side (``packed_segments``)."""
    joined_bias: bool = False
    """The bias is parameters and buffers concatenated (BEiT's ``cat(q_bias, zeros_k, v_bias)``), not one parameter:
    a column split asks for it split as its outputs are, which splits those parts (or slices a buffer, which no
    gradient reaches); a row split is not offered (its bias, added once after the all-reduce, must be one tensor)."""
    experts: int = 1
    """The experts whose matrices lie one after another along the parameter's first storage dim, when the weight
    is one of them (a 2-D parameter viewed as ``(experts, rows, ...)`` and indexed per expert, as DBRX's
    ``w1.view(-1, ffn, hidden)[e]``): its features are one expert's, and the parameter is split as that expert
    is, once per expert (``per_expert``)."""
    spatial: int = 0
    """A dense convolution over this many trailing spatial dims (``N, C, *spatial``): a projection of the
    channels at every position, so its features are dim 1 (weight ``[out, in, *kernel]``), ``in_axis`` and
    ``out_axis`` ``-1 - spatial``."""


@dataclass(frozen=True)
class Embedding:
    """``aten.embedding(W, ids)`` with ``W`` a parameter."""

    node: str
    weight: str
    ids: str
    num_embeddings: int


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


def _segment(node) -> tuple[str, int, int, int, int] | None:
    """(``get_attr`` target, dim, start, length, the parameter's size along dim) if ``node`` is a contiguous slice
    of a parameter along one dim: ``W.split(sizes)[i]`` (``split``, ``split_with_sizes``, ``chunk``) or ``W[a:b]``."""
    cut = _slice_of(node)
    if cut is None:
        return None
    source, dim, start, length, size = cut
    target = param_attr(source)
    return (target, dim, start, length, size) if target is not None and 0 < length < size else None


def _slice_of(node) -> tuple[fx.Node, int, int, int, int] | None:
    """(the value sliced, dim, start, length, its size along dim) if ``node`` is a contiguous slice of a value
    along one dim (``split``, ``split_with_sizes`` or ``chunk`` then one part, or ``x[a:b]``)."""
    if not isinstance(node, fx.Node) or node.op != "call_function":
        return None
    if node.target is operator.getitem and isinstance(node.args[0], fx.Node) and node.args[0].target in _SPLITS:
        split, i = node.args[0], node.args[1]
        source, parts = split.args[0], meta_val(split)
        dim = arg_or_default(split, 2, "dim", 0) % len(parts[i].shape)
        start = sum(int(p.shape[dim]) for p in parts[:i])
    elif node.target is aten.slice.Tensor and arg_or_default(node, 4, "step", 1) == 1:
        source, dim = node.args[0], arg_or_default(node, 1, "dim", 0) % len(meta_val(node).shape)
        size = int(meta_val(source).shape[dim])
        start = arg_or_default(node, 2, "start", None) or 0
        if not isinstance(start, int):
            return None
        start = max(start + size, 0) if start < 0 else min(start, size)
    else:
        return None
    if not isinstance(source, fx.Node):
        return None
    return source, dim, start, int(meta_val(node).shape[dim]), int(meta_val(source).shape[dim])


def _part_of_joined(node) -> str | None:
    """The ``get_attr`` target of the one parameter ``node`` is, cut back out of parameters concatenated end to end:
    torch's ``multi_head_attention_forward`` given separate Q/K/V weights joins their biases and chunks them again
    (``cat([q_bias, k_bias, v_bias]).chunk(3)[i]``, WavLM's attention). None if it is not exactly one part."""
    cut = _slice_of(node)
    if cut is None or not _joined(cut[0]):
        return None
    source, _, start, length, _ = cut
    at = 0
    for part in source.args[0]:
        size = int(meta_val(part).shape[0])
        if at == start and size == length:
            return param_attr(part)
        at += size
    return None


_SPLITS = {aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default}


def _transposed_attr(node) -> str | None:
    """The ``get_attr`` target if ``node`` is a parameter with its last two dims swapped (``W.t()``, as in
    ``x @ W.t()``, or ``W.transpose(-2, -1)`` of a 3-D expert bank)."""
    swapped = _swapped(node)
    return param_attr(swapped) if swapped is not None else None


def _swapped(node) -> fx.Node | None:
    """The value ``node`` is with its last two dims swapped (``W.t()``, ``W.T``, ``W.transpose(-2, -1)``), or None."""
    if not isinstance(node, fx.Node) or node.op != "call_function":
        return None
    n = len(meta_val(node).shape)
    last_two = {n - 2, n - 1}
    swaps = (node.target is aten.t.default or (node.target is aten.numpy_T.default and n == 2)
             or (node.target is aten.transpose.int and {node.args[1] % n, node.args[2] % n} == last_two)
             or (node.target is aten.permute.default and n == 2 and list(node.args[1]) in ([1, 0], [-1, -2])))
    return node.args[0] if swaps else None


def _projection(node: fx.Node, specs: dict) -> Projection | None:
    """A Projection if ``node`` multiplies an activation by a parameter (2-D, or 3-D for a grouped matmul)."""
    spec = specs.get(node.target)
    if spec is None or node.kwargs.get("beta", 1) != 1 or node.kwargs.get("alpha", 1) != 1:
        return None
    xi, wi, bi, out_dim = spec
    if len(node.args) <= wi:
        return None
    weight_node = node.args[wi]
    weight = param_attr(weight_node)
    ndim = 2 if node.target in _PROJECTION_OPS else 3
    out_dim += ndim - 2
    bank = 0  # the dims before the matrix in the parameter's storage: one for an expert's matrix of a bank
    experts = 1  # the experts' matrices one after another along the storage's first dim (``expert_banks.folded_expert``)
    if weight is None and ndim == 2 and expert_attr(weight_node) is not None:
        weight, bank = expert_attr(weight_node), 1
    if weight is None and ndim == 2 and folded_expert(weight_node) is not None:
        weight, experts = folded_expert(weight_node)
    if weight is None and _transposed_attr(weight_node) is not None:
        # x @ W.t(): the parameter's output features sit on the other storage dim.
        weight, out_dim, weight_node = _transposed_attr(weight_node), 2 * ndim - 3 - out_dim, weight_node.args[0]
    if weight is None and ndim == 2 and folded_expert(_swapped(weight_node)) is not None:
        (weight, experts), out_dim = folded_expert(_swapped(weight_node)), 1 - out_dim
        weight_node = _swapped(weight_node)
    segment = _segment(weight_node) if weight is None and ndim == 2 else None
    packed = None
    if segment is not None and segment[1] == out_dim:  # a slice of a packed parameter's output features
        weight, packed = segment[0], segment[2:]
    x = node.args[xi]
    if weight is None or not isinstance(x, fx.Node) or param_attr(x) is not None:
        return None
    shape = meta_val(weight_node).shape
    if len(shape) != ndim:
        return None
    in_dim = 2 * ndim - 3 - out_dim
    bias_node = node.args[bi] if bi is not None and len(node.args) > bi else None
    bias = param_attr(bias_node) if packed is None else _packed_bias(bias_node, packed)
    if bias is None and packed is None:
        bias = _part_of_joined(bias_node)
    joined = bias is None and packed is None and _joined(bias_node)
    if bias_node is not None and bias is None and not joined:
        return None  # a computed bias: leave the op alone
    return Projection(node=node.name, input=x.name, weight=weight, bias=bias, out_dim=out_dim + bank,
                      in_features=int(shape[in_dim]), out_features=int(shape[out_dim]), in_dim=in_dim + bank,
                      packed=packed, joined_bias=joined, experts=experts)

def _joined(node) -> bool:
    """Whether ``node`` concatenates parameters and buffers end to end (``cat([q_bias, k_bias, v_bias])``)."""
    return (isinstance(node, fx.Node) and node.target is aten.cat.default and len(meta_val(node).shape) == 1
            and all(param_attr(part) is not None for part in node.args[0]))


def _packed_bias(node, packed: tuple[int, int, int]) -> str | None:
    """The packed bias parameter if ``node`` is its slice matching the weight's (``in_proj_bias.split(...)[i]``)."""
    segment = _segment(node)
    return segment[0] if segment is not None and segment[1] == 0 and segment[2:] == packed else None


def packed_by_weight(projections: list[Projection]) -> dict[str, list[Projection]]:
    """The projections on slices of packed parameters, by parameter."""
    out: dict[str, list[Projection]] = {}
    for p in projections:
        if p.packed is not None:
            out.setdefault(p.weight, []).append(p)
    return out


def packed_segments(projections: list[Projection], segments: dict[str, tuple[int, ...]]) -> tuple[int, ...] | None:
    """The segments of a packed parameter, from the ``projections`` on its slices (each with its ``segments``, else
    its output features whole), in the parameter's order; None unless the slices tile the parameter exactly (a
    slice read by no projection found could not be placed)."""
    ordered = sorted(projections, key=lambda p: p.packed[0])
    at, out = 0, []
    for p in ordered:
        start, length, _ = p.packed
        if start != at:
            return None
        out += segments.get(p.node) or (length,)
        at += length
    return tuple(out) if ordered and at == ordered[0].packed[2] else None


def segment_of(shard, packed: tuple[int, int, int]):
    """The split of one slice ``packed`` of a packed parameter split as ``shard`` (the segments inside it), or None
    when the slice does not start and end at segment boundaries."""
    start, length, _ = packed
    bounds = [sum(shard.segments[:i]) for i in range(len(shard.segments) + 1)]
    if start not in bounds or start + length not in bounds:
        return None
    return dataclasses.replace(shard, segments=shard.segments[bounds.index(start):bounds.index(start + length)])


def _left_projection(node: fx.Node) -> Projection | None:
    """A Projection if ``node`` is ``W @ x`` with ``W`` a 2-D parameter (or its transpose) and ``x`` at least 2-D."""
    if node.target is not aten.matmul.default or len(node.args) < 2 or not isinstance(node.args[1], fx.Node):
        return None
    weight_node, x = node.args
    weight, out_dim = param_attr(weight_node), 0
    if weight is None and _transposed_attr(weight_node) is not None:
        weight, out_dim, weight_node = _transposed_attr(weight_node), 1, weight_node.args[0]
    if weight is None or param_attr(x) is not None or len(meta_val(weight_node).shape) != 2 or len(meta_val(x).shape) < 2:
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
    weight = param_attr(weight_node)
    if weight is None or not isinstance(x, fx.Node) or param_attr(x) is not None or "->" not in node.args[0]:
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


# op -> index of ``groups`` (a convolution's; ``aten.convolution`` also says whether it is transposed, at 6); the
# ``padding`` overloads take the padding as a word (``padding="valid"``, as SigLIP's patch embedding gives it)
CONVOLUTIONS = {aten.conv1d.default: 6, aten.conv2d.default: 6, aten.conv3d.default: 6,
                aten.conv1d.padding: 6, aten.conv2d.padding: 6, aten.conv3d.padding: 6,
                aten.convolution.default: 8}


def conv_groups(node: fx.Node) -> int:
    """The ``groups`` of a convolution node (1 when not given)."""
    index = CONVOLUTIONS[node.target]
    return node.args[index] if len(node.args) > index else node.kwargs.get("groups", 1)


def is_grouped_convolution(node: fx.Node) -> bool:
    """Whether ``node`` is a grouped convolution: more than one group, not transposed (split by whole groups)."""
    if node.op != "call_function" or node.target not in CONVOLUTIONS or conv_groups(node) == 1:
        return False
    return not (node.target is aten.convolution.default and node.args[6])


def _conv_projection(node: fx.Node) -> Projection | None:
    """A Projection if ``node`` is a dense (one group, not transposed) convolution of a batched activation by a
    parameter: column-split, it slices the weight's output channels; row-split, its input channels, the
    partial sums all-reduced. Grouped convolutions are split with their channels by their own rule."""
    if node.target not in CONVOLUTIONS or conv_groups(node) != 1 or len(node.args) < 2 or "bias" in node.kwargs:
        return None
    if node.target is aten.convolution.default and node.args[6]:
        return None
    x, weight_node = node.args[0], node.args[1]
    weight = param_attr(weight_node)
    if weight is None or not isinstance(x, fx.Node) or param_attr(x) is not None:
        return None
    shape = meta_val(weight_node).shape
    if len(meta_val(x).shape) != len(shape):
        return None  # an unbatched input (``C, L``): its channels are dim 0
    bias_node = node.args[2] if len(node.args) > 2 else None
    bias = param_attr(bias_node)
    if bias_node is not None and bias is None:
        return None
    return Projection(node=node.name, input=x.name, weight=weight, bias=bias, out_dim=0, in_dim=1,
                      in_features=int(shape[1]), out_features=int(shape[0]), spatial=len(shape) - 2,
                      in_axis=1 - len(shape), out_axis=1 - len(shape))


def find_projections(graph: fx.Graph) -> dict[str, Projection]:
    """Every projection in ``graph``, keyed by node name, in graph order."""
    specs = _PROJECTION_OPS | grouped_ops()
    found = (_projection(n, specs) or _left_projection(n) or _einsum_projection(n) or _conv_projection(n)
             for n in graph.nodes if n.op == "call_function" and not _of_weights(n))
    return {p.node: p for p in found if p is not None}


def _of_weights(node: fx.Node) -> bool:
    """A product of parameters only (DoRA's ``B @ A``): a weight computed from weights, not a layer of activations."""
    args = [a for a in node.args if isinstance(a, fx.Node)]
    return len(args) >= 2 and all(param_attr(a) is not None for a in args)


def find_embeddings(graph: fx.Graph) -> dict[str, Embedding]:
    """Every embedding lookup of a parameter table, keyed by node name."""
    out = {}
    for node in graph.find_nodes(op="call_function", target=aten.embedding.default):
        weight = param_attr(node.args[0])
        if weight is not None and isinstance(node.args[1], fx.Node):
            out[node.name] = Embedding(node=node.name, weight=weight, ids=node.args[1].name,
                                       num_embeddings=int(meta_val(node.args[0]).shape[0]))
    return out
