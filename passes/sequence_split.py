"""Context parallelism's layout: which values of a captured graph each rank holds as its own tokens only.

Read-only. Starting from the token ids (split along the sequence), every op that treats positions apart (linear
layers, norms, activations, rotary products, a softmax over keys) keeps the split; a value computed whole (a
rotary table from ``arange``, a position table, a causal or padding mask) that meets a split one is read at the
rank's own positions; attention's keys and values are gathered whole, so that each rank's queries see exactly
the keys the unsharded model lets them see; anything else that reads across positions gathers its input whole
first (exact, at the cost of the communication, and listed). Random draws and in-place writes on split values
are refused: they could not match the unsharded model.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import sympy
import torch
from torch import fx

from autotp.passes.attention_chains import SDPA, ExplicitAttention, explicit_attentions, hoisted_repeats
from autotp.passes.graph import SHAPE_META, meta_val, mutated_args
from autotp.passes.rule_kit import norm_dim
from autotp.passes.sequence_merge import plain, view_split
from autotp.torch_private import is_op_overload

aten = torch.ops.aten

# Ops that keep each position apart and need no argument rewritten, beyond broadcasting (``Tag.pointwise``
# covers the arithmetic; these are the casts, copies and checks around it).
_ELEMENTWISE = {aten.masked_fill.Scalar, aten.masked_fill.Tensor, aten.where.self, aten.clone.default,
                aten.contiguous.default, aten.to.dtype, aten.to.dtype_layout, aten.to.device, aten._to_copy.default,
                aten.type_as.default, aten.alias.default, aten.detach.default, aten.lift_fresh_copy.default,
                aten.dropout.default, aten.silu.default, aten.gelu.default, aten.relu.default,
                aten.layer_norm.default, aten.rms_norm.default}
_VIEWS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default}
_REDUCTIONS = {aten.mean.dim, aten.sum.dim_IntList, aten.amax.default, aten.amin.default, aten.var.correction,
               aten.std.correction, aten.logsumexp.default}
_SOFTMAX = {aten.softmax.int, aten._softmax.default, aten.log_softmax.int, aten._log_softmax.default}
_MULTI = {aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default, aten.unbind.int}
_RANDOM = {aten.dropout.default, aten.native_dropout.default, aten.bernoulli.default, aten.bernoulli.p,
           aten.rand_like.default, aten.randn_like.default}
_CHECK = aten._assert_tensor_metadata.default
_FULL_END = 2 ** 62  # a slice ``x[a:]`` records its end as the largest int64


@dataclass
class ContextLayout:
    """What the rewrite does to run a graph context-parallel (all keyed by node name).

    ``split``: nodes computed on the rank's own tokens, with the dim that holds them (tuple outputs: every part).
    ``inputs``: placeholders taken at the rank's positions (their sequence dim). ``gathers``: (node, argument)
    whose split value is gathered whole first; ``selects``: (node, argument, dim) whose whole value is read at
    the rank's positions along ``dim``; ``sizes``: (node, index into its size list) set to the local length;
    ``causal``: attentions whose ``is_causal`` becomes an explicit mask of the rank's query rows; ``lengths``:
    sizes read off a split value's sequence dim, which stand for the whole length; ``exchanges``: attentions (an
    SDPA, an explicit ``softmax(QK^T)V``'s ``@ v`` product, or another product whose right operand is gathered)
    whose keys or values are gathered, and ``kv``: those
    gathers (attention's exchange, apart from the gathers of ops that read across positions);
    ``crossing``: ops read across positions (their inputs gathered: exact, but communicated), for the notes;
    ``refused``: why the graph cannot run context-parallel (empty: it can)."""

    seq: object
    split: dict[str, int] = field(default_factory=dict)
    inputs: dict[str, int] = field(default_factory=dict)
    gathers: list[tuple[str, str]] = field(default_factory=list)
    selects: list[tuple[str, str, int]] = field(default_factory=list)
    sizes: list[tuple[str, tuple]] = field(default_factory=list)
    causal: list[str] = field(default_factory=list)
    lengths: list[str] = field(default_factory=list)
    exchanges: list[str] = field(default_factory=list)
    kv: set[tuple[str, str]] = field(default_factory=set)
    crossing: list[str] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)
    hoisted: dict[str, str] = field(default_factory=dict)
    """``repeat_kv``'s nodes (computed whole after the gather of their source) -> their attention."""
    methods: dict[str, str] = field(default_factory=dict)
    """Each attention's exchange (``planning.context_exchange``): all_gather, ring or ulysses."""
    fallbacks: list[str] = field(default_factory=list)
    """Notes on attentions the chosen method could not take (exchanged by all-gather instead)."""
    merged: dict[str, tuple] = field(default_factory=dict)
    """Split values whose split dim merges the sequence with others (``passes.sequence_merge``): (outer, inner)
    positions around it (GPT-2's ``[B*T, C]``: (B, 1)); gathered by unflattening it."""
    explicit: dict[str, ExplicitAttention] = field(default_factory=dict)
    """Explicit ``softmax(QK^T)V`` attentions, by their ``@ v`` product (named in ``exchanges``; their ``q @ k^T``
    product is not)."""

    def owner(self, name: str) -> str:
        """The attention (an SDPA, or an explicit attention's ``@ v`` product) that node ``name`` is part of or
        feeds through ``repeat_kv``; ``name`` itself when none."""
        name = self.hoisted.get(name, name)
        return next((out for out, e in self.explicit.items() if name in e.members), name)

    @property
    def attention(self) -> int:
        """How many attention ops exchange keys or values."""
        return len(self.exchanges)


def _sizes(node) -> tuple | None:
    """``node``'s sizes (ints and sympy expressions), or None for a non-tensor."""
    recorded = node.meta.get(SHAPE_META) if isinstance(node, fx.Node) else None
    if recorded is not None:
        return tuple(recorded)
    val = meta_val(node)
    if isinstance(val, torch.Tensor):
        return tuple(sympy.sympify(str(s)) if not isinstance(s, int) else s for s in val.shape)
    return None


def _is(size, seq) -> bool:
    """Whether a size is exactly the sequence length."""
    return not isinstance(size, int) and sympy.sympify(size) == seq


def context_layout(graph: fx.Graph, seq, token_inputs: dict[str, int]) -> ContextLayout:
    """The context-parallel layout of ``graph`` whose sequence length is the sympy symbol ``seq``, with the
    placeholders ``token_inputs`` (name -> sequence dim) split along it."""
    layout = ContextLayout(seq, inputs=dict(token_inputs))
    layout.split.update(token_inputs)
    hoisted = layout.hoisted = hoisted_repeats(graph)
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        if node.name in hoisted and node.args[0].name in layout.split:
            layout.gathers.append((node.name, node.args[0].name))  # gathered before repeat_kv, not after
            layout.kv.add((node.name, node.args[0].name))
            if hoisted[node.name] not in layout.exchanges:
                layout.exchanges.append(hoisted[node.name])
        else:
            _visit(node, layout)
    layout.explicit = explicit_attentions(graph, layout.split, hoisted)
    scores = {e.scores for e in layout.explicit.values()}
    layout.exchanges = [n for n in layout.exchanges if n not in scores]  # one exchange per attention
    return layout


def _tensor_args(node: fx.Node) -> list[fx.Node]:
    """The tensor-valued node arguments of ``node`` (inside lists too), in order."""
    out = []
    for arg in [*node.args, *node.kwargs.values()]:
        for a in (arg if isinstance(arg, (list, tuple)) else [arg]):
            if isinstance(a, fx.Node) and isinstance(meta_val(a), torch.Tensor) and a not in out:
                out.append(a)
    return out


def _visit(node: fx.Node, layout: ContextLayout) -> None:
    split = [a for a in _tensor_args(node) if a.name in layout.split]
    if node.target is operator.getitem:
        if isinstance(node.args[0], fx.Node) and node.args[0].name in layout.split:
            layout.split[node.name] = layout.split[node.args[0].name]
            if node.args[0].name in layout.merged:
                layout.merged[node.name] = layout.merged[node.args[0].name]
        return
    if not split:
        return
    if node.target in _RANDOM and _draws(node):
        layout.refused.append(f"{node.name} ({node.target}) draws random numbers per position; the unsharded model "
                              "draws them over the whole sequence: set its probability to 0 (or train without it)")
        return
    if mutated_args(node):
        layout.refused.append(f"{node.name} ({node.target}) writes in place into a value split along the sequence")
        return
    rule = _rule_for(node)
    merged = {layout.merged.get(a.name) for a in split}
    if merged != {None} and (rule not in _MERGED_SAFE or len(merged) != 1):
        rule = None  # a dim merging the sequence with others: only ops that keep its rows apart follow it
    dim = rule(node, layout, split) if rule is not None else None
    if dim is None:
        _gather_all(node, layout, split)
    elif dim is not _HANDLED:
        layout.split[node.name] = dim
        if rule is not _view and merged != {None}:
            layout.merged[node.name] = merged.pop()


_HANDLED = object()
"""A rule's answer when it recorded the node itself (it gathered what it needed)."""


def _draws(node: fx.Node) -> bool:
    """Whether a random op really draws (dropout at p=0, or outside training, does not)."""
    if node.target in (aten.dropout.default, aten.native_dropout.default):
        p, train = node.args[1], node.args[2] if len(node.args) > 2 else True
        return bool(train) and p != 0
    return True


def _gather_all(node: fx.Node, layout: ContextLayout, split: list[fx.Node]) -> None:
    """``node`` reads across positions: its split inputs are gathered whole, and it is computed whole."""
    for a in split:
        layout.gathers.append((node.name, a.name))
    layout.crossing.append(f"{node.name} ({node.target})")


def _rule_for(node: fx.Node):
    target = node.target
    if target in _ELEMENTWISE or (is_op_overload(target) and torch.Tag.pointwise in target.tags):
        return _broadcast
    return _RULES.get(target)


def _broadcast(node: fx.Node, layout: ContextLayout, split: list[fx.Node]):
    """An op position by position with broadcasting: split inputs line up; whole ones with a sequence-long dim
    there are read at the rank's positions. Norms normalise trailing dims, which must not hold the sequence."""
    out = _sizes(node)
    if out is None:
        return None
    dims = {layout.split[a.name] + len(out) - len(_sizes(a)) for a in split}
    if len(dims) != 1:
        return None
    dim = dims.pop()
    if node.target in (aten.layer_norm.default, aten.rms_norm.default) and dim >= len(out) - len(node.args[1]):
        return None
    merged = any(a.name in layout.merged for a in split)
    for a in _tensor_args(node):
        if a.name in layout.split:
            continue
        sizes = _sizes(a)
        at = dim - (len(out) - len(sizes))
        if at >= 0 and merged and sizes[at] != 1:
            return None  # a whole value along a merged dim: its rows are not read at positions
        if at >= 0 and _is(sizes[at], layout.seq):
            layout.selects.append((node.name, a.name, at))
    return dim


def _linear(node, layout, split):
    x = node.args[0]
    if split != [x]:
        return None
    d = layout.split[x.name]
    return d if d < len(_sizes(x)) - 1 else None


def _matmul(node, layout, split):
    """``a @ b``: ``a`` split along its rows (or batch dims) keeps the split; a split ``b`` (keys, values) is
    gathered whole first."""
    a, b = node.args[0], node.args[1]
    if b in split:
        layout.gathers.append((node.name, b.name))
        layout.kv.add((node.name, b.name))
        layout.exchanges.append(node.name)
    if a.name not in layout.split:
        return _HANDLED
    da, ra = layout.split[a.name], len(_sizes(a))
    if ra < 2 or da == ra - 1:
        layout.gathers.append((node.name, a.name))
        return _HANDLED
    return da + len(_sizes(node)) - ra


def _softmax(node, layout, split):
    x, d = node.args[0], layout.split[node.args[0].name]
    return d if norm_dim(node.args[1], len(_sizes(x))) != d else None


def _dims_of(node, rank: int) -> list[int] | None:
    """The dims a reduction or squeeze names (its second argument), made non-negative; None: every dim."""
    dims = node.args[1] if len(node.args) > 1 else None
    if dims is None:
        return None
    return [norm_dim(k, rank) for k in ([dims] if isinstance(dims, int) else dims)]


def _reduction(node, layout, split):
    x = node.args[0]
    d, rank = layout.split[x.name], len(_sizes(x))
    dims = _dims_of(node, rank)
    if dims is None:
        return None
    keep = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
    if d in dims:
        return None
    return d if keep else d - sum(1 for k in dims if k < d)


def _view(node, layout, split):
    """A reshape keeps the split when one output dim holds the sequence with the same positions before and after
    it (``passes.sequence_merge``): exactly the sequence (the size given for it becomes the local length), or the
    sequence merged with dims around it (GPT-2's ``[B*T, C]``; given as -1, the local size follows)."""
    x = node.args[0]
    found = view_split(_sizes(x), layout.split[x.name], layout.merged.get(x.name, (1, 1)), _sizes(node), layout.seq)
    if found is None:
        return None
    od, factors = found
    if plain(factors):
        if node.args[1][od] != -1:
            layout.sizes.append((node.name, (1, od)))
        return od
    if node.args[1][od] != -1 or not isinstance(factors[1], (int, sympy.Integer)):
        return None  # a merged size spelled out (it would be the whole one), or inner dims of dynamic size
    layout.merged[node.name] = (factors[0], int(factors[1]))
    return od


def _addmm(node, layout, split):
    """``bias + x @ w`` (GPT-2's ``Conv1D``): ``x``'s rows keep the split."""
    return 0 if split == [node.args[1]] and layout.split[node.args[1].name] == 0 else None


def _expand(node, layout, split):
    x = node.args[0]
    od = layout.split[x.name] + len(node.args[1]) - len(_sizes(x))
    if node.args[1][od] != -1 and x.name in layout.merged:
        return None
    if node.args[1][od] != -1:
        layout.sizes.append((node.name, (1, od)))
    return od


def _transpose(node, layout, split):
    x = node.args[0]
    rank, d = len(_sizes(x)), layout.split[x.name]
    a, b = norm_dim(node.args[1], rank), norm_dim(node.args[2], rank)
    return b if d == a else a if d == b else d


def _permute(node, layout, split):
    x = node.args[0]
    rank = len(_sizes(x))
    return [norm_dim(k, rank) for k in node.args[1]].index(layout.split[x.name])


def _unsqueeze(node, layout, split):
    x = node.args[0]
    d, at = layout.split[x.name], norm_dim(node.args[1], len(_sizes(x)) + 1)
    return d + 1 if at <= d else d


def _squeeze(node, layout, split):
    x = node.args[0]
    d, rank = layout.split[x.name], len(_sizes(x))
    dims = _dims_of(node, rank)
    if dims is None:
        return None
    return None if d in dims else d - sum(1 for k in dims if k < d)


def _slice(node, layout, split):
    """A slice of another dim keeps the split; of the sequence itself only when it keeps all of it."""
    x = node.args[0]
    d, rank = layout.split[x.name], len(_sizes(x))
    dim = norm_dim(node.args[1] if len(node.args) > 1 else 0, rank)
    if dim != d:
        return d
    start = node.args[2] if len(node.args) > 2 else None
    end = node.args[3] if len(node.args) > 3 else None
    step = node.args[4] if len(node.args) > 4 else 1
    whole_end = end is None or (isinstance(end, int) and end >= _FULL_END) or (
        isinstance(end, fx.Node) and _is(_sym(end), layout.seq))
    return d if start in (None, 0) and whole_end and step == 1 else None


def _sym(node: fx.Node):
    val = meta_val(node)
    return sympy.sympify(str(val)) if val is not None and not isinstance(val, int) else val


def _select(node, layout, split):
    x = node.args[0]
    d, dim = layout.split[x.name], norm_dim(node.args[1], len(_sizes(x)))
    return None if dim == d else d - (1 if dim < d else 0)


def _multi(node, layout, split):
    """split/chunk/unbind along another dim: every part keeps the split (unbind drops its dim)."""
    x = node.args[0]
    d, rank = layout.split[x.name], len(_sizes(x))
    if node.target is aten.unbind.int:
        dim = norm_dim(node.args[1] if len(node.args) > 1 else 0, rank)
        return None if dim == d else d - (1 if dim < d else 0)
    dim = norm_dim(node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0), rank)
    return None if dim == d else d


def _cat(node, layout, split):
    """A cat along another dim: split parts line up, whole parts are read at the rank's positions."""
    parts, out = node.args[0], _sizes(node)
    dim = norm_dim(node.args[1] if len(node.args) > 1 else 0, len(out))
    dims = {layout.split[p.name] for p in parts if p.name in layout.split}
    if len(dims) != 1 or dim in dims:
        return None
    d = dims.pop()
    for p in parts:
        if p.name not in layout.split and _is(_sizes(p)[d], layout.seq):
            layout.selects.append((node.name, p.name, d))
    return d


def _embedding(node, layout, split):
    weight, ids = node.args[0], node.args[1]
    return layout.split[ids.name] if split == [ids] else None


def _length(node, layout, split):
    """A size read off a value: of its split dim, the graph meant the whole sequence (the rewrite says so)."""
    if layout.split[node.args[0].name] == norm_dim(node.args[1], len(_sizes(node.args[0]))):
        if node.args[0].name in layout.merged:
            return None  # not the sequence's length: the whole size is read off the gathered value
        layout.lengths.append(node.name)
    return _HANDLED


def _attention(node, layout, split):
    """SDPA: queries split along their sequence dim keep it; keys and values are gathered whole; a whole mask is
    read at the rank's query rows, and ``is_causal`` becomes such a mask."""
    q, k, v = node.args[:3]
    mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
    dropout = node.args[4] if len(node.args) > 4 else node.kwargs.get("dropout_p", 0.0)
    if dropout:
        layout.refused.append(f"{node.name}: attention dropout draws per position; set it to 0")
        return _HANDLED
    rank = len(_sizes(q))
    for x in (k, v):
        if x.name in layout.split:
            layout.gathers.append((node.name, x.name))
            layout.kv.add((node.name, x.name))
    if k.name in layout.split or v.name in layout.split:
        layout.exchanges.append(node.name)
    if q.name not in layout.split:
        return _HANDLED
    if layout.split[q.name] != rank - 2:
        layout.gathers.append((node.name, q.name))
        return _HANDLED
    if isinstance(mask, fx.Node):
        m = _sizes(mask)
        if mask.name in layout.split and layout.split[mask.name] != len(m) - 2:
            layout.gathers.append((node.name, mask.name))
        elif mask.name not in layout.split and len(m) >= 2 and _is(m[-2], layout.seq):
            layout.selects.append((node.name, mask.name, len(m) - 2))
    causal = node.args[5] if len(node.args) > 5 else node.kwargs.get("is_causal", False)
    if causal:
        layout.causal.append(node.name)
    return rank - 2


_RULES = {aten.linear.default: _linear, aten.matmul.default: _matmul, aten.bmm.default: _matmul,
          aten.mm.default: _matmul, **dict.fromkeys(_SOFTMAX, _softmax), **dict.fromkeys(_REDUCTIONS, _reduction),
          **dict.fromkeys(_VIEWS, _view), aten.expand.default: _expand, aten.transpose.int: _transpose,
          aten.permute.default: _permute, aten.unsqueeze.default: _unsqueeze, aten.squeeze.dim: _squeeze,
          aten.squeeze.dims: _squeeze, aten.slice.Tensor: _slice, aten.select.int: _select,
          **dict.fromkeys(_MULTI, _multi), aten.cat.default: _cat, aten.embedding.default: _embedding,
          SDPA: _attention, aten.sym_size.int: _length, _CHECK: lambda n, l, s: _HANDLED,
          aten.addmm.default: _addmm}
_MERGED_SAFE = {_broadcast, _linear, _matmul, _addmm, _softmax, _reduction, _view, _expand, _transpose, _permute,
                _unsqueeze, _squeeze, _slice, _select, _multi, _embedding, _length, _RULES[_CHECK]}
"""Rules that follow a merged split dim (``ContextLayout.merged``): they keep its rows apart, or refuse."""
