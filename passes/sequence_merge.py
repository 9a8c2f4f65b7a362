"""Where a reshape puts the sequence, when it merges the sequence dim with others (GPT-2's ``Conv1D`` views
``[B, T, C]`` as ``[B*T, C]`` for an ``addmm``, a model's own loss views logits as ``[B*T, V]``).

A value split along the sequence holds, at its split dim, ``outer x T x inner`` positions in row-major order
(``outer = inner = 1`` for a plain split): rank ``r``'s local value holds ``outer x t x inner`` of them, its own
``t`` positions of each outer index, and every inner one. That stays true through a reshape as long as the
positions before and after the sequence in row-major order (``prefix``, ``suffix``) are what the output's dims
around the merged one hold, which is what ``view_split`` checks. Read-only and pure.
"""

from __future__ import annotations

import sympy

Factors = tuple[object, object]
"""(outer, inner) of a merged split dim: sympy expressions; (1, 1) for a plain split."""


def _product(sizes) -> object:
    return sympy.Mul(*[sympy.sympify(s) for s in sizes])


def _whole_factor(expr) -> object | None:
    """``expr`` when it is a product of sizes (a polynomial, no division), else None."""
    expr = sympy.cancel(sympy.sympify(expr))
    return expr if sympy.fraction(expr)[1] == 1 else None


def view_split(before: tuple, d: int, factors: Factors, out: tuple, seq) -> tuple[int, Factors] | None:
    """(the output dim holding the sequence, its factors) of a reshape of a value of sizes ``before`` split at
    ``d`` (with ``factors``) into sizes ``out``; None when the output splits the sequence across dims (its
    positions could not be kept apart)."""
    outer, inner = factors
    prefix = _product(before[:d]) * outer
    suffix = inner * _product(before[d + 1:])
    for od, size in enumerate(out):
        a = _whole_factor(prefix / _product(out[:od]))
        if a is None:
            return None  # the dims before od already hold more than the prefix: the sequence is cut across them
        c = _whole_factor(sympy.sympify(size) / (a * seq))
        if c is not None and not c.has(seq) and not a.has(seq) and sympy.simplify(
                c * _product(out[od + 1:]) - suffix) == 0:
            return od, (a, c)
    return None


def plain(factors: Factors | None) -> bool:
    """Whether a split dim holds the sequence alone."""
    return factors is None or (factors[0] == 1 and factors[1] == 1)
