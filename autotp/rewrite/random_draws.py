"""Random ops made exact: every rank draws what the unsharded model draws, then keeps its slice.

Each rank's random ops draw from one stream (``rewrite.streams.RankStream``), seeded the same on every rank: a value
kept whole gets the same draw on every rank whatever the ranks' global generators hold, and a split
value gets this rank's slice of the full-size draw. The draws run torch's own ops on torch's
generator, with the stream's state swapped in for the duration, so a single process seeded with the
same seed draws bit-identical masks (measured: CPU ``dropout`` and ``scaled_dot_product_attention``'s
internal dropout both consume one generator draw per call).
"""

from __future__ import annotations

import math

import torch
from torch import fx, nn

from autotp.errors import InternalError
from autotp.passes.placement import Layout, Shard
from autotp.passes.random_ops import RandomKind, attention_dropout, random_kind
from autotp.passes.reshapes import static
from autotp.rewrite.graph_edit import STANDS_FOR
from autotp.rewrite.shards import local_part
from autotp.rewrite.streams import RankStream

aten = torch.ops.aten


def _full_size(x: torch.Tensor, layout: Layout, tp: int) -> list[int]:
    """The unsharded size of a local value ``x`` laid out as ``layout``."""
    size = list(x.shape)
    if isinstance(layout, Shard):
        if layout.spread:
            raise InternalError("a random op on a KV head spread over its query heads: autotp merges those first")
        if layout.blocks == 1 and static(layout.size) is not None:
            size[layout.dim] = int(layout.size)  # also where the chunks differ (a vocabulary cut unevenly)
        else:
            size[layout.dim] *= layout.chunks(tp)
    return size


def _full_like(x: torch.Tensor, layout: Layout, tp: int) -> torch.Tensor:
    """Ones of the unsharded size of ``x``, with ``x``'s dim order in memory.

    Torch draws a mask into ``empty_like(input)``, which keeps the input's memory order (a transposed
    input gets a transposed mask): the same draw lands on the same elements only if the full-size
    stand-in has the same order.
    """
    if not isinstance(layout, Shard):
        return torch.ones_like(x)  # exactly the layout torch's own empty_like(input) gives
    # The order empty_like gives x (it makes an expanded or overlapping value dense in its own way), at full size.
    like = torch.empty_like(x)
    order = sorted(range(x.dim()), key=lambda d: (-like.stride(d), d))
    size = _full_size(x, layout, tp)
    stored = torch.ones([size[d] for d in order], dtype=x.dtype, device=x.device)
    return stored.permute([order.index(d) for d in range(x.dim())])


class _Random(nn.Module):
    """A random op of the rank graph: knows this rank's slice of its output and the stream to draw from."""

    def __init__(self, stream: RankStream, layout: Layout, rank: int, tp: int):
        super().__init__()
        self.stream, self.layout, self.rank, self.tp = stream, layout, rank, tp

    def local(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's part of a full-size draw."""
        if not isinstance(self.layout, Shard):
            return full
        return local_part(full, self.layout, self.rank, self.tp)


class Dropout(_Random, nn.Dropout):
    """``dropout(x, p, train)`` (or ``native_dropout``, or in place): the full-size noise, this rank's slice
    applied.

    An ``nn.Dropout``, so that what switches a model's dropout off by its modules (TRL's ``disable_dropout_in_model``:
    ``module.p = 0`` on every ``nn.Dropout``) switches this one off too: with ``p`` 0 it returns its input and draws
    nothing, as torch's dropout does."""

    def __init__(self, stream, layout, rank, tp, target, p: float, train: bool):
        super().__init__(stream, layout if not isinstance(layout, tuple) else layout[0], rank, tp)
        self.target, self.p, self.train_arg = target, float(p), bool(train)

    def forward(self, x):
        if self.target is aten.native_dropout.default:
            return self._native(x)
        if self.p == 0 or not self.train_arg or x.numel() == 0:
            return x  # torch draws nothing in these cases either
        with self.stream.drawing(x.device):
            # dropout(ones) is exactly the scaled noise dropout multiplies its input by.
            noise = aten.dropout.default(_full_like(x, self.layout, self.tp), self.p, True)
        if self.target is aten.dropout_.default:  # in place, as the model wrote it: later readers of x see it
            return x.mul_(self.local(noise))
        return x * self.local(noise)

    def _native(self, x):
        with self.stream.drawing(x.device):
            _, mask = aten.native_dropout.default(_full_like(x, self.layout, self.tp), self.p, self.train_arg)
        mask = self.local(mask)
        if not self.train_arg or self.p == 0:
            return x.clone(), mask
        return x.mul(mask).mul_(1.0 / (1.0 - self.p)), mask


class SizeOnly(_Random):
    """An op that draws a tensor the size of its first input (``rand_like``): drawn full-size, sliced."""

    def __init__(self, stream, layout, rank, tp, target, args: tuple, kwargs: dict):
        super().__init__(stream, layout, rank, tp)
        self.target, self.args, self.kwargs = target, args, kwargs

    def forward(self, x):
        full = _full_like(x, self.layout, self.tp)
        with self.stream.drawing(x.device):
            return self.local(self.target(full, *self.args, **self.kwargs))


class WholeInputs(_Random):
    """An op whose inputs are whole on every rank: run as it is, on the stream."""

    def __init__(self, stream, target):
        super().__init__(stream, None, 0, 1)
        self.target = target

    def forward(self, *args, **kwargs):
        device = next((a.device for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)),
                      torch.device(kwargs.get("device") or "cpu"))
        with self.stream.drawing(device):
            return self.target(*args, **kwargs)


class AttentionDropout(_Random):
    """``scaled_dot_product_attention`` with dropout, written out as torch's math path (which CPU runs for
    it, bit for bit), the attention-probability mask drawn full-size across the heads and sliced."""

    def __init__(self, stream, layout, rank, tp, dropout_p: float, is_causal: bool, scale, enable_gqa: bool):
        super().__init__(stream, layout, rank, tp)
        self.dropout_p, self.is_causal, self.scale, self.enable_gqa = dropout_p, is_causal, scale, enable_gqa

    def forward(self, q, k, v, attn_mask=None):
        scale = math.sqrt(self.scale if self.scale is not None else 1.0 / math.sqrt(q.shape[-1]))
        if self.enable_gqa and k.shape[-3] != q.shape[-3]:
            k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
            v = v.repeat_interleave(q.shape[-3] // v.shape[-3], dim=-3)
        attn = (q * scale) @ (k.transpose(-2, -1) * scale)
        if self.is_causal:
            causal = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
            attn = attn.masked_fill(~causal, float("-inf"))
        if attn_mask is not None:
            attn = attn.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool else attn + attn_mask
        attn = aten._safe_softmax.default(attn, -1)
        with self.stream.drawing(q.device):
            noise = aten.dropout.default(_full_like(attn, self.layout, self.tp), self.dropout_p, True)
        return (attn * self.local(noise)) @ v


def _module_for(node: fx.Node, kind: RandomKind, layout: Layout, stream: RankStream, rank: int, tp: int):
    """The module replacing random ``node``, and the arguments it is called with."""
    if kind is RandomKind.DROPOUT:
        p, train = node.args[1], node.args[2]
        return Dropout(stream, layout, rank, tp, node.target, p, train), (node.args[0],), {}
    if kind is RandomKind.SIZE_ONLY:
        return SizeOnly(stream, layout, rank, tp, node.target, node.args[1:], dict(node.kwargs)), (node.args[0],), {}
    if kind is RandomKind.ATTENTION_DROPOUT:
        get = lambda i, name, default: node.args[i] if len(node.args) > i else node.kwargs.get(name, default)  # noqa: E731
        module = AttentionDropout(stream, layout, rank, tp, attention_dropout(node), bool(get(5, "is_causal", False)),
                                  get(6, "scale", None), bool(get(7, "enable_gqa", False)))
        return module, tuple(node.args[:3]), {"attn_mask": get(3, "attn_mask", None)}
    return WholeInputs(stream, node.target), node.args, dict(node.kwargs)


def replace_random_ops(gm: fx.GraphModule, layouts: dict[str, Layout], stream: RankStream, rank: int,
                       tp: int) -> int:
    """Replace every random op of ``gm`` by a module drawing from ``stream``; returns how many."""
    count = 0
    for node in list(gm.graph.nodes):
        kind = random_kind(node)
        if kind is None:
            continue
        module, args, kwargs = _module_for(node, kind, layouts.get(node.name), stream, rank, tp)
        name = f"autotp_random_{count}"
        gm.add_submodule(name, module)
        with gm.graph.inserting_after(node):
            new = gm.graph.call_module(name, args, kwargs)
        new.meta = dict(node.meta) | {STANDS_FOR: node.name}
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
        count += 1
    if count:
        gm.graph.lint()
        gm.recompile()
    return count
