"""Sizes written in plan files (``"B*T"``, ``"64"``, ``"(T//2)"``), parsed without evaluating any Python.

A plan file is data someone else may have written; ``sympy.sympify`` would ``eval`` it. The planner writes each
dim of a collective's shape as sympy prints a size of the captured graph: integers, size symbols, ``+ - * /``,
``//``, small integer powers (``T**2``), parentheses and the functions sympy and torch print for sizes
(``floor``, ``ceiling``, ``Max``, ``Min``, ``Mod``, ``PythonMod``). This module reads exactly that language with a
small recursive-descent parser that builds the sympy expression itself; anything else is refused.
"""

from __future__ import annotations

import re

import sympy

MAX_LENGTH = 256
"""Longest size text accepted; a planner-written size is a few symbols long."""
MAX_DIGITS = 20
MAX_EXPONENT = 16
"""Bounds that keep evaluation cheap: a huge literal or power (``9**9**9``) could take minutes to expand."""
MAX_DEPTH = 32

_TOKEN = re.compile(r"\s*(?:(?P<int>\d+)|(?P<name>[A-Za-z_][A-Za-z_0-9]*)|(?P<op>//|\*\*|[-+*/(),]))")
_FUNCTIONS = {"floor": (sympy.floor, 1), "ceiling": (sympy.ceiling, 1), "Max": (sympy.Max, 2),
              "Min": (sympy.Min, 2), "Mod": (sympy.Mod, 2), "PythonMod": (sympy.Mod, 2)}
"""Function name -> (sympy function, argument count). ``PythonMod`` is torch's modulo, equal to ``Mod`` on the
non-negative sizes plans hold."""


class ShapeSyntaxError(ValueError):
    """A size text outside the plan-file size language; the message says where and what is accepted."""


def _tokens(text: str) -> list[tuple[str, str]]:
    out, at = [], 0
    text = text.rstrip()
    while at < len(text):
        match = _TOKEN.match(text, at)
        if match is None:
            raise ShapeSyntaxError(f"unexpected {text[at:].lstrip()[:10]!r} at character {at}")
        kind = match.lastgroup
        out.append((kind, match.group(kind)))
        at = match.end()
    return out


class _Parser:
    """expr := term (("+" | "-") term)*;  term := unary (("*" | "/" | "//") unary)*;
    unary := "-" unary | power;  power := atom ("**" INT)?;
    atom := INT | NAME | FUNCTION "(" expr ("," expr)* ")" | "(" expr ")"."""

    def __init__(self, tokens: list[tuple[str, str]]):
        self.tokens, self.at, self.depth = tokens, 0, 0

    def peek(self) -> tuple[str, str] | None:
        return self.tokens[self.at] if self.at < len(self.tokens) else None

    def take(self, op: str | None = None) -> tuple[str, str]:
        token = self.peek()
        if token is None:
            raise ShapeSyntaxError("the text ends too early" + (f" (expected {op!r})" if op else ""))
        if op is not None and token != ("op", op):
            raise ShapeSyntaxError(f"expected {op!r}, found {token[1]!r}")
        self.at += 1
        return token

    def expr(self):
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise ShapeSyntaxError(f"nested deeper than {MAX_DEPTH} levels")
        value = self.term()
        while self.peek() in (("op", "+"), ("op", "-")):
            value = value + self.term() if self.take()[1] == "+" else value - self.term()
        self.depth -= 1
        return value

    def term(self):
        value = self.unary()
        while self.peek() in (("op", "*"), ("op", "/"), ("op", "//")):
            op, right = self.take()[1], self.unary()
            if op != "*" and right == 0:
                raise ShapeSyntaxError("division by zero")
            value = value * right if op == "*" else value / right if op == "/" else sympy.floor(value / right)
        return value

    def unary(self):
        if self.peek() == ("op", "-"):
            self.take()
            return -self.unary()
        return self.power()

    def power(self):
        base = self.atom()
        if self.peek() != ("op", "**"):
            return base
        self.take()
        kind, text = self.take()
        if kind != "int" or int(text) > MAX_EXPONENT:
            raise ShapeSyntaxError(f"a power must be a whole number up to {MAX_EXPONENT}, found {text!r}")
        return base ** int(text)

    def atom(self):
        kind, text = self.take()
        if kind == "int":
            if len(text) > MAX_DIGITS:
                raise ShapeSyntaxError(f"the number {text[:12]}... has more than {MAX_DIGITS} digits")
            return sympy.Integer(int(text))
        if kind == "name":
            if self.peek() != ("op", "("):
                return sympy.Symbol(text)
            if text not in _FUNCTIONS:
                raise ShapeSyntaxError(f"unknown function {text!r} (sizes may use {', '.join(_FUNCTIONS)})")
            function, count = _FUNCTIONS[text]
            self.take("(")
            args = [self.expr()]
            while self.peek() == ("op", ","):
                self.take()
                args.append(self.expr())
            self.take(")")
            if len(args) != count:
                raise ShapeSyntaxError(f"{text} takes {count} argument(s), found {len(args)}")
            return function(*args)
        if text == "(":
            value = self.expr()
            self.take(")")
            return value
        raise ShapeSyntaxError(f"unexpected {text!r}")


def parse_size(text) -> sympy.Expr:
    """The sympy expression of one size written in a plan file (a non-negative ``int`` is taken as is).

    ``ShapeSyntaxError`` (a ``ValueError``) says why anything else is refused; nothing in ``text`` is evaluated
    as Python.
    """
    if isinstance(text, int) and not isinstance(text, bool) and text >= 0:
        return sympy.Integer(text)
    if not isinstance(text, str):
        raise ShapeSyntaxError(f"a size is a string such as \"B*T\" or \"64\", got {text!r} "
                               f"({type(text).__name__})")
    if len(text) > MAX_LENGTH:
        raise ShapeSyntaxError(f"longer than {MAX_LENGTH} characters")
    parser = _Parser(_tokens(text))
    if not parser.tokens:
        raise ShapeSyntaxError("empty")
    value = parser.expr()
    if parser.peek() is not None:
        raise ShapeSyntaxError(f"unexpected {parser.peek()[1]!r} after a complete size")
    return value
