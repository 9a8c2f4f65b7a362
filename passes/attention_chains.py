"""Attention as context parallelism sees it in a captured graph: transformers' ``repeat_kv`` between an attention
and the keys or values it reads (``hoisted_repeats``), and an explicit ``softmax(QK^T)V`` (``explicit_attentions``:
``q @ k^T``, an optional scale, an optional mask, a softmax over keys, ``@ v``), which a ring or Ulysses exchange
computes as it computes SDPA. Read-only.

The ring merges every key block into running softmax statistics (row maximum and sum), which is the softmax over
all keys, so replacing the explicit chain by it is exact up to fp32 rounding, as for SDPA. Only a chain that is
exactly that is taken: no cast that changes the dtype (the ring computes in the queries' dtype), dropout only at
p=0, the scale before the mask, and every intermediate read by the next op alone (scores or probabilities the
model also returns stay as they are, exchanged by all-gather).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import fx

from autotp.passes.graph import meta_val
from autotp.passes.rule_kit import norm_dim

aten = torch.ops.aten
SDPA = aten.scaled_dot_product_attention.default
_MATMUL = aten.matmul.default
_VIEWS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default}
# Ops that only rearrange (or repeat) a tensor: a gather moved above them moves the same values, or fewer.
_REARRANGING = {*_VIEWS, aten.expand.default, aten.unsqueeze.default, aten.transpose.int, aten.permute.default,
                aten.clone.default, aten.contiguous.default, aten.slice.Tensor}
# Ops between the scores and the product with V that change nothing when they keep the dtype.
_PASSING = {aten.to.dtype, aten.to.dtype_layout, aten._to_copy.default, aten.type_as.default, aten.clone.default,
            aten.contiguous.default, aten.alias.default}
_SOFTMAX = {aten.softmax.int, aten._softmax.default}
_CHECK = aten._assert_tensor_metadata.default  # export's dtype checks after a cast: no value, no effect


def hoisted_repeats(graph: fx.Graph) -> dict[str, str]:
    """The nodes of transformers' ``repeat_kv`` (unsqueeze, expand, reshape, and the full slices and transposes
    around them) between an attention's keys or values and the op that made them, each read by that one consumer:
    they are computed whole, after one gather of their source, so grouped-query attention moves its KV heads, not
    the repeated ones (and a ring or Ulysses exchange moves the source). Each maps to its consumer's name (an SDPA,
    or a product of an explicit attention)."""
    out = {}
    for node in graph.nodes:
        if node.target is SDPA:
            operands = node.args[1:3]
        elif node.target is _MATMUL:
            operands = node.args[1:2]
        else:
            continue
        for value in operands:
            chain = []
            while (isinstance(value, fx.Node) and value.target in _REARRANGING and len(value.users) == 1
                   and isinstance(value.args[0], fx.Node)):
                chain.append(value)
                value = value.args[0]
            for at, link in enumerate(chain):
                if link.target is aten.unsqueeze.default and any(c.target is aten.expand.default for c in chain[:at]):
                    out.update((c.name, node.name) for c in chain[:at + 1])
                    break
    return out


@dataclass(frozen=True)
class ExplicitAttention:
    """One explicit ``softmax(q k^T * scale + mask) v`` of a graph, keyed in the layout by its ``@ v`` product."""

    scores: str
    """The ``q @ k^T`` product."""
    q: str
    """Queries ``[B, H, T, D]``."""
    k: str
    """Keys ``[B, Hkv, T, D]``: before the transpose and any ``repeat_kv``."""
    v: str
    """Values ``[B, Hkv, T, D]``: before any ``repeat_kv``."""
    scale: float | str
    """What the scores are multiplied by: a number, or the name of a 0-dim tensor node."""
    divides: bool
    """Whether the scores are divided by ``scale`` (``/ sqrt(d)``) rather than multiplied."""
    mask_op: str | None
    """The op that masks the scores (``+ mask`` or ``masked_fill(cond, -inf)``), or None."""
    mask_arg: int
    """Which argument of ``mask_op`` the mask is."""
    added: bool
    """True: the mask is added (a float mask); False: ``masked_fill``'s condition (True: the key is masked)."""
    members: tuple[str, ...]
    """Every node of the chain from the scores to the probabilities (and export's checks on them)."""


def explicit_attentions(graph: fx.Graph, split: dict[str, int],
                        hoisted: dict[str, str]) -> dict[str, ExplicitAttention]:
    """Every explicit ``softmax(QK^T)V`` of ``graph`` whose queries, keys and values are split along their sequence
    dim (``split``: node name -> the dim holding the rank's tokens; ``hoisted``: ``hoisted_repeats``), by the name
    of its ``@ v`` product."""
    out = {}
    for node in graph.nodes:
        if node.target is _MATMUL:
            found = _explicit(node, split, hoisted)
            if found is not None:
                out[node.name] = found
    return out


def _only_reader(node: fx.Node) -> fx.Node | None:
    """The one op reading ``node`` (export's dtype checks aside), or None."""
    readers = [u for u in node.users if u.target is not _CHECK]
    return readers[0] if len(readers) == 1 else None


def _checks(node: fx.Node) -> list[str]:
    return [u.name for u in node.users if u.target is _CHECK]


def _same_dtype(node: fx.Node, source: fx.Node) -> bool:
    a, b = meta_val(node), meta_val(source)
    return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype


def _back(node: fx.Node, chain: list[fx.Node], through) -> fx.Node:
    """Walk up from ``node`` while ``through(node)``, each step read only by the one before; the chain walked is
    appended to ``chain``."""
    while isinstance(node, fx.Node) and through(node) and _only_reader(node.args[0]) is node:
        chain.append(node)
        node = node.args[0]
    return node


def _passing(node: fx.Node) -> bool:
    if node.target is aten.dropout.default:  # p=0 (or not training): the identity
        return node.args[1] == 0 or (len(node.args) > 2 and not node.args[2])
    return node.target in _PASSING and _same_dtype(node, node.args[0])


def _kv_source(value, hoisted: dict[str, str]):
    while isinstance(value, fx.Node) and value.name in hoisted:
        value = value.args[0]
    return value


def _up(start, reader: fx.Node, chain: list[fx.Node]) -> fx.Node | None:
    """``_back`` from ``start`` when ``reader`` is the one op reading it, else None."""
    if not isinstance(start, fx.Node) or _only_reader(start) is not reader:
        return None
    return _back(start, chain, _passing)


def _explicit(out: fx.Node, split: dict[str, int], hoisted: dict[str, str]) -> ExplicitAttention | None:
    chain: list[fx.Node] = []
    soft = _up(out.args[0], out, chain)
    if soft is None or soft.target not in _SOFTMAX:
        return None
    rank = len(meta_val(soft).shape)
    if norm_dim(soft.args[1], rank) != rank - 1 or not _same_dtype(soft, soft.args[0]):
        return None
    chain.append(soft)
    x = _up(soft.args[0], soft, chain)
    for mask_op, mask_arg, added in (*_masks(x), (None, 0, True)):
        found = _scaled_scores(out, x, mask_op, mask_arg, added, list(chain), split, hoisted)
        if found is not None:
            return found
    return None


def _scaled_scores(out, x, mask_op, mask_arg, added, chain, split, hoisted) -> ExplicitAttention | None:
    """The attention when ``x`` is ``[(q @ k^T) * scale] [masked by mask_op]``, else None."""
    if mask_op is not None:
        chain.append(x)
        x = _up(x.args[1 - mask_arg if added else 0], mask_op, chain)
    scale, divides = 1.0, False
    if x is not None and x.target in (aten.mul.Tensor, aten.div.Tensor) and _scalar(x.args[1]):
        chain.append(x)
        scale, divides = (x.args[1].name if isinstance(x.args[1], fx.Node) else float(x.args[1]),
                          x.target is aten.div.Tensor)
        x = _up(x.args[0], x, chain)
    if x is None or x.target is not _MATMUL:
        return None
    v = _kv_source(out.args[1], hoisted)
    q, k = x.args[0], _keys(x.args[1], hoisted)
    if k is None or any(not _tokens_of(t, split) for t in (q, k, v)):
        return None
    chain.append(x)
    if x.args[1].name not in hoisted and _only_reader(x.args[1]) is x:
        chain.append(x.args[1])  # k^T, read by the scores alone
    members = [n.name for n in chain] + [c for n in chain for c in _checks(n)]
    return ExplicitAttention(x.name, q.name, k.name, v.name, scale, divides, mask_op.name if mask_op else None,
                             mask_arg, added, tuple(members))


def _masks(node) -> list[tuple[fx.Node, int, bool]]:
    """The ways ``node`` may mask the scores: (the op, the mask's argument index, whether the mask is added)."""
    if not isinstance(node, fx.Node):
        return []
    if node.target is aten.add.Tensor and len(node.args) == 2 and all(isinstance(a, fx.Node) for a in node.args):
        return [(node, 1, True), (node, 0, True)]  # the mask is whichever operand the scores are not
    if node.target is aten.masked_fill.Scalar and node.args[2] == -math.inf:
        return [(node, 1, False)]
    return []


def _scalar(value) -> bool:
    """A number, or a 0-dim tensor node (GPT-2 divides by ``torch.full([], sqrt(d))``)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return True
    val = meta_val(value)
    return isinstance(val, torch.Tensor) and val.dim() == 0


def _keys(kt, hoisted: dict[str, str]) -> fx.Node | None:
    """The keys ``[B, Hkv, T, D]`` whose transpose ``kt`` is (through ``repeat_kv``'s hoisted nodes)."""
    if isinstance(kt, fx.Node) and kt.name in hoisted:
        source = _kv_source(kt, hoisted)
        return source if kt.target is aten.transpose.int and _last_two(kt) else None
    if isinstance(kt, fx.Node) and kt.target is aten.transpose.int and _last_two(kt):
        return kt.args[0]
    return None


def _last_two(node: fx.Node) -> bool:
    rank = len(meta_val(node).shape)
    return {norm_dim(node.args[1], rank), norm_dim(node.args[2], rank)} == {rank - 2, rank - 1}


def _tokens_of(node, split: dict[str, int]) -> bool:
    """Whether ``node`` is ``[B, heads, T, D]`` split along T."""
    val = meta_val(node)
    return isinstance(val, torch.Tensor) and val.dim() == 4 and split.get(node.name) == 2
