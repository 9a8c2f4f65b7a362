"""Shape-only kernels for a few ops while ``torch.export`` traces, where torch's cost most per node.

Export's training graph records ``linear``, ``layer_norm``, ``matmul`` and ``scaled_dot_product_attention`` as
single nodes before their kernels run, yet to learn the outputs' sizes torch then runs their composite kernels on
fake tensors: a ``linear`` of a 4-d input reshapes, multiplies and views it back; attention's math path (taken
whenever the mask needs a gradient, as Swin's relative-position bias does) and every batched matmul (Swin V2's
cosine attention) expand, reshape, copy and multiply. Each of those steps pays sympy for every size that holds
the symbolic batch; so does ``view``. On the tiny Swins the four composites and the views were a third of the
capture.

A stand-in here gives the output torch's kernel would, computed directly: the size, a fresh contiguous layout
(what the composites return, for the operand dtypes and shapes the stand-in accepts), and the gradient
requirement (an autograd Function applied to the inputs). Anything else (mixed dtypes, broadcast batch dims, the
fused attention kernel, a strided layer-norm input, sizes not statically equal or data-dependent) goes to
torch's own kernel. ``view``'s fake kernel splits and merges dims one fake tensor at a time; its stand-in runs
the same algorithm, comparison for comparison (so with the same expressions and guards), on tuples of sizes and
strides, and makes one tensor at the end (``view_layout``).

Skipping torch's kernels must not skip what they teach the shape environment either: a check a kernel makes
(attention's mask broadcast against the scores) can fix a symbol's range or tie two symbols, and a later op's
choice reads that (whether a full slice is elided). The stand-ins make the checks torch's would and hand on the
sizes torch's would (an elementwise kernel passes its input's sizes on; a reshaping one computes new ones). The
captured graphs are node for node and meta for meta the same as without them: ``tests/test_shape_kernels.py``,
and ``python -m bench.shape_kernels`` over the zoo.

They are registered only while ``shape_only_kernels()`` is open, so the process is left as it was found; eager
runs never consult them.
"""

from __future__ import annotations

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true

from autotp.capture.speedups.view_layout import positive_product, view_layout
from autotp.torch_private import (attention_backend, broadcast_sizes, composite_kernels_replaced,
                                          contiguous_or_false, real_tensors, size_hint, symbolic_expr,
                                          torch_composite, torch_fake_view)
from autotp.errors import InternalError

aten = torch.ops.aten


class _SizedLike(torch.autograd.Function):
    """A fresh tensor of ``size`` shaped like ``like``, marked as computed from ``inputs``, so it requires a
    gradient exactly when the real op's output would. Used only on fake tensors while tracing."""

    @staticmethod
    def forward(ctx, size, strides, like, *inputs):
        return like.new_empty_strided(size, strides)

    @staticmethod
    def backward(ctx, *grads):
        raise InternalError("a shape-only stand-in was differentiated; it exists only while torch.export traces")


def _same_sizes(a, b) -> bool:
    """Whether two size tuples are equal without adding a guard (symbolic sizes must be the same expression)."""
    return len(a) == len(b) and all(statically_known_true(x == y) for x, y in zip(a, b))


def _fresh(size):
    """A symbolic size as a new SymInt of the same expression: torch's kernels compute their outputs' sizes, and
    the tracer reads a size from the first tensor it met it on, so handing the input's own SymInt on would make
    later ``x.size(d)`` read the input instead of the output."""
    return size * 1 if isinstance(size, torch.SymInt) else size


def _backed(size) -> tuple | None:
    """``size`` where every symbolic size in it is a product of size symbols (backed, so known positive), else
    None. torch writes the strides of such sizes the same way on every path (``Max(1, s)`` is ``s``); for others
    (a padded length's ``Mod`` and ``//``, a data-dependent size) its kernels differ in how they write them, and
    theirs is the form the graph must keep."""
    for n in size:
        if isinstance(n, torch.SymInt) and (size_hint(n) is None
                                            or not positive_product(symbolic_expr(n), powers=False)):
            return None
    return size


def _sized(size, like, *inputs, computed: bool = True):
    """A fresh tensor of ``size`` like ``like``, contiguous (its strides written as plain products, as torch's
    kernels write them for such sizes), requiring a gradient if an input does. ``computed``: its sizes are new
    SymInts, as a kernel that reshapes computes them; else the inputs' own, as an elementwise kernel passes them on
    (which of the two a later size read finds decides whether torch elides a full slice of it)."""
    size = tuple(_fresh(n) for n in size) if computed else tuple(size)
    strides, inner = [], 1
    for n in reversed(size):
        strides.insert(0, inner)
        inner = inner * n
    return _SizedLike.apply(size, tuple(strides), like, *(t for t in inputs if isinstance(t, torch.Tensor)))


def attention_size(query, key, value, enable_gqa: bool = False):
    """The output size of ``scaled_dot_product_attention(query, key, value)``, or None where the shapes are not the
    plain case (equal batch dims, heads equal or grouped with ``enable_gqa``) and torch's kernel should decide."""
    if not (query.dim() == key.dim() == value.dim() >= 3):
        return None
    if not (_same_sizes(query.shape[-1:], key.shape[-1:]) and _same_sizes(key.shape[-2:-1], value.shape[-2:-1])):
        return None
    leading = 3 if enable_gqa and query.dim() == 4 else 2  # grouped heads: only the batch dims must match
    batch_q, batch_k, batch_v = (t.shape[:-leading] for t in (query, key, value))
    if not (_same_sizes(batch_q, batch_k) and _same_sizes(batch_q, batch_v)):
        return None
    return _backed((*query.shape[:-1], value.shape[-1]))


def _real_probe(t):
    """An uninitialised real CPU tensor with a fake tensor's sizes (the example's), strides, dtype and gradient
    flag, for asking torch a question about metadata; None where a size has no example value."""
    sizes, strides = [size_hint(s) for s in t.shape], [size_hint(s) for s in t.stride()]
    if None in sizes or None in strides:
        return None
    return torch.empty_strided(sizes, strides, dtype=t.dtype).requires_grad_(t.requires_grad)


def _math_path(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa) -> bool:
    """Whether torch's attention would take its math path (whose output is a fresh contiguous tensor; the fused
    CPU kernel's output is laid out otherwise). Asked of torch itself, on real stand-ins of the example's sizes."""
    if query.device.type != "cpu":
        return False
    with real_tensors():
        probes = [_real_probe(t) for t in (query, key, value)]
        mask = _real_probe(attn_mask) if isinstance(attn_mask, torch.Tensor) else None
        if None in probes or (isinstance(attn_mask, torch.Tensor) and mask is None):
            return False
        choice = attention_backend(*probes, mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)
    return choice == int(torch.nn.attention.SDPBackend.MATH)


def _attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    size = attention_size(query, key, value, enable_gqa)
    if size is None or not _math_path(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa):
        return torch_composite(aten.scaled_dot_product_attention.default, query, key, value, attn_mask, dropout_p, is_causal,
                       scale=scale, enable_gqa=enable_gqa)
    if isinstance(attn_mask, torch.Tensor):
        # the math path adds the mask to the scores: the same broadcast check, so the shape environment learns
        # what it would (a mask's length equal to the keys', found here, lets a later full slice be elided)
        broadcast_sizes((*query.shape[:-1], key.shape[-2]), attn_mask.shape)
    return _sized(size, query, query, key, value, attn_mask, computed=False)


def matmul_size(a, b):
    """The output size of ``a @ b`` for batched operands of one rank whose batch dims are the same, else None."""
    if not (a.dim() == b.dim() >= 3 and _same_sizes(a.shape[:-2], b.shape[:-2])
            and _same_sizes(a.shape[-1:], b.shape[-2:-1])):
        return None
    return _backed((*a.shape[:-1], b.shape[-1]))


def _matmul(a, b):
    size = matmul_size(a, b)
    if size is None or a.dtype != b.dtype:
        return torch_composite(aten.matmul.default, a, b)
    return _sized(size, a, a, b)


def _one_dtype(*tensors) -> bool:
    """Whether every tensor given (None skipped) has the first one's dtype: mixed precision is torch's to decide."""
    given = [t for t in tensors if isinstance(t, torch.Tensor)]
    return all(t.dtype == given[0].dtype for t in given)


def linear_size(x, weight, bias=None):
    """The output size of ``linear(x, weight, bias)`` for an input of rank 2 or more whose features are statically
    the weight's, else None."""
    if not (x.dim() >= 2 and weight.dim() == 2 and _same_sizes(x.shape[-1:], weight.shape[1:])):
        return None
    if bias is not None and not (bias.dim() == 1 and _same_sizes(bias.shape, weight.shape[:1])):
        return None
    return _backed((*x.shape[:-1], weight.shape[0]))


def _linear(x, weight, bias=None):
    size = linear_size(x, weight, bias)
    if size is None or not _one_dtype(x, weight, bias):
        return torch_composite(aten.linear.default, x, weight, bias)
    return _sized(size, x, x, weight, bias)


def _layer_norm(x, normalized_shape, weight=None, bias=None, eps=1e-5, cudnn_enable=True):
    # a contiguous input only: torch's fake kernel lays a strided input's output out like the input
    plain = (0 < len(normalized_shape) <= x.dim() and _one_dtype(x, weight, bias) and _backed(x.shape)
             and contiguous_or_false(x)
             and _same_sizes(x.shape[x.dim() - len(normalized_shape):], tuple(normalized_shape)))
    if not plain:
        return torch_composite(aten.layer_norm.default, x, normalized_shape, weight, bias, eps, cudnn_enable)
    return _sized(x.shape, x, x, weight, bias, computed=False)  # elementwise: the input's sizes


STAND_INS = {aten.scaled_dot_product_attention.default: _attention, aten.matmul.default: _matmul,
             aten.linear.default: _linear, aten.layer_norm.default: _layer_norm}
"""Composite op -> its shape-only kernel while tracing."""


def _view(fake_mode, func, a, *shape):
    layout = view_layout(a, shape)
    if layout is None:
        return torch_fake_view(fake_mode, func, a, *shape)
    return torch.as_strided(a, *layout, a.storage_offset())


def shape_only_kernels():
    """``STAND_INS`` registered as the ops' Python composite kernels (and ``_view`` as fake tensors' ``view``)
    while inside; torch's restored after (the fence's ``composite_kernels_replaced``)."""
    return composite_kernels_replaced(STAND_INS, _view)
