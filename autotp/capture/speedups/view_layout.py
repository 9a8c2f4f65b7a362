"""``view``'s sizes and strides, computed as torch's fake kernel computes them but on tuples.

torch's fake ``view`` (its refs' ``_reshape_view_helper``) merges and splits dims one at a time, making a fake
tensor for each step, and each pays sympy for its symbolic sizes and contiguity. ``view_layout`` runs the same
algorithm, comparison for comparison (so with the same expressions, guards and runtime checks), on tuples of sizes
and strides; ``shape_kernels`` then makes the one tensor at the end.
"""

from __future__ import annotations

import torch

from autotp.torch_private import (backed_size_oblivious, check, contiguous_or_false, inferred_shape,
                                          shape_of_varargs, size_hint, symbolic_expr, symbolic_size,
                                          view_has_unbacked_input)


def _collapsed(sizes: tuple, strides: tuple, numel, start: int, end: int) -> tuple | None:
    """Dims ``start..end`` merged into one, as torch's ``prims._collapse_view_helper`` writes the result (the same
    comparisons, in the same order, so the same expressions and guards), or None where no view exists."""
    from torch.fx.experimental.symbolic_shapes import guard_or_false, guard_or_true, sym_and, sym_or

    valid = True
    if guard_or_false(numel != 0):
        for i in range(end - 1, start - 1, -1):
            valid = sym_and(valid, sym_or(sizes[i] == 1, sizes[i + 1] == 1, strides[i] == strides[i + 1] * sizes[i + 1]))
            if guard_or_false(valid is False):
                break
    if not guard_or_false(sym_or(valid, numel == 0)):
        return None
    stride = strides[end]
    for i in range(end - 1, start - 1, -1):
        if sizes[i] != 1:
            stride = min(stride, strides[i])
    length = sizes[end]
    if guard_or_true(length != 0):
        for i in range(end - 1, start - 1, -1):
            if guard_or_false(sizes[i] == 0):
                length, stride = 0, 0
                break
            length = length * sizes[i]
    else:
        stride = 0
    if guard_or_false(numel == 0):
        return None  # an empty tensor is restrided as contiguous: torch's
    return sizes[:start] + (length,) + sizes[end + 1:], strides[:start] + (stride,) + strides[end + 1:]


def _split(sizes: tuple, strides: tuple, dim: int, outer) -> tuple | None:
    """Dim ``dim`` split into ``outer`` and the rest, as torch's ``prims.split_dim`` writes it, or None where
    ``outer`` does not divide it."""
    inner = sizes[dim] // outer
    if (sizes[dim] % outer) != 0:
        return None
    return (sizes[:dim] + (outer, inner) + sizes[dim + 1:],
            strides[:dim] + (strides[dim] * inner, strides[dim]) + strides[dim + 1:])


def positive_product(expr, powers: bool = True) -> bool:
    """Whether a sympy size expression is a positive integer times a product of size symbols (with ``powers``,
    positive powers of them too): known positive, so written alike by every torch path."""
    import sympy

    coefficient, rest = expr.as_coeff_Mul()
    return coefficient.is_Integer and coefficient > 0 and all(
        p.is_Symbol or (powers and p.is_Pow and p.base.is_Symbol and p.exp.is_Integer and p.exp > 0)
        for p in sympy.Mul.make_args(rest) if p != 1)


def _exact_quotient(numel, known):
    """``numel / known`` where it is a polynomial in the size symbols with integer coefficients (so it is what
    torch's floor division simplifies to, and its divisibility checks are statically true), else None. sympy
    cancels a product by a product on construction; torch's ``FloorDiv`` instead finds the common factor and
    calls ``sympy.simplify`` (whose first call imports ``sympy.physics``, a quarter of a second)."""
    import sympy

    if not isinstance(numel, torch.SymInt) or isinstance(known, int) and known == 0:
        return None
    divisor = symbolic_expr(known) if isinstance(known, torch.SymInt) else sympy.Integer(known)
    quotient = symbolic_expr(numel) / divisor
    if not all(positive_product(term) for term in sympy.Add.make_args(quotient)):
        return None
    return symbolic_size(quotient, numel, size_hint(numel) // size_hint(known))


def _inferred(shape, numel) -> tuple:
    """``shape`` with its ``-1`` inferred from ``numel`` (as torch's ``infer_size``), by an exact quotient where
    there is one."""
    infer_size = inferred_shape
    free = [i for i, d in enumerate(shape) if isinstance(d, int) and d == -1]
    if len(free) != 1:
        return infer_size(shape, numel)
    known = 1
    for i, d in enumerate(shape):
        if i != free[0]:
            known = known * d
    quotient = _exact_quotient(numel, known)
    if quotient is None:
        return infer_size(shape, numel)
    return (*shape[:free[0]], quotient, *shape[free[0] + 1:])


def view_layout(a, shape) -> tuple | None:
    """The sizes and strides ``a.view(shape)`` has, computed as torch's reshape algorithm computes them
    (torch's refs' ``_reshape_view_helper``: the same checks and expressions, dim by dim) but on tuples, not on a
    fake tensor per step; None for the cases torch's kernel must take (sizes without an example value, an empty or
    0-d input or output, the 1-d special cases, a view that does not exist)."""
    from functools import reduce
    from operator import mul

    if backed_size_oblivious() or view_has_unbacked_input(a, shape):
        return None
    shape = _inferred(shape_of_varargs(shape, validate=False), a.numel())
    if a.numel() == 0 or a.ndim == 0 or len(shape) == 0:
        return None
    if contiguous_or_false(a) and ((len(shape) == 1 and a.ndim > 1) or (len(shape) == 2 and a.ndim == 1)):
        return None
    check(a.numel() == reduce(mul, shape, 1), lambda: f"Could not reshape {a.shape} as {shape}!")
    sizes, strides, numel, i = tuple(a.shape), tuple(a.stride()), a.numel(), 0
    for length in shape:
        if i >= len(sizes):  # a trailing 1
            if length != 1:
                return None
            sizes, strides = _split(sizes, strides, len(sizes) - 1, sizes[-1])
            i += 1
            continue
        if length == sizes[i]:
            i += 1
            continue
        accum, end = sizes[i], i
        while accum % length != 0:
            end += 1
            accum *= sizes[end]
        if end != i:
            merged = _collapsed(sizes, strides, numel, i, end)
            if merged is None:
                return None
            sizes, strides = merged
        if accum != length:
            split = _split(sizes, strides, i, length)
            if split is None:
                return None
            sizes, strides = split
        i += 1
    while i < len(sizes):
        check(sizes[i] == 1, lambda: f"a.size({i}) expected to be 1 but got {sizes[i]}")
        sizes, strides = sizes[:i] + sizes[i + 1:], strides[:i] + strides[i + 1:]
    return sizes, strides
