"""Blocks that differ only in a float attribute, stamped with each block's own value.

A vision transformer trained with stochastic depth gives each block its own drop rate (``linspace(0, rate,
depth)``: Swin, BEiT, Data2Vec-vision, DeiT III); in training the rate is a constant of the block's graph
(``x.div(1 - p)``), so no two blocks trace the same graph and none could be stamped out (``capture.repeats``).

While the two captured units are traced, each float attribute that varies along the run is replaced by a
``Tracked`` float: the same value, which records how every float computed from it was computed (``1 - p``) and
every decision taken on it (``p == 0``, ``int(p)``, ``float(p)``). The graph holds plain numbers, so a constant
of the two units that differ is explained by a recorded computation giving the first unit's number from its
values and the second's from its own; a stamped unit then holds that computation of its own values, and every
recorded decision must come out the same for it, or the run is not stamped. What Python code does with the
value out of sight (``math.sqrt(p)``, a C extension reading it) is not recorded: where that reaches the graph the
two units' numbers differ with nothing to explain them, and the run is not stamped.
"""

from __future__ import annotations

import contextlib
import math
import operator
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

from torch import nn

Key = tuple[int, str, str]
"""A varying attribute: the block's position in its unit, the submodule's path in the block, the attribute."""
Values = Mapping[Key, float]
"""One unit's value of each varying attribute."""


@dataclass
class Log:
    """What the tracked floats of one capture recorded."""

    derived: list[Tracked] = field(default_factory=list)
    """Every varying attribute's tracked value, and every float computed from one, in order."""
    decisions: list[tuple[Callable[[Values], object], object]] = field(default_factory=list)
    """Every decision taken on one: how to take it for a unit's values, and what it came to while tracing."""

    def explains(self, first: float, second: float, values: tuple[Values, Values]) -> Callable[[Values], float] | None:
        """The recorded computation that gives the first unit's number from its values and the second's from its
        own, if one does."""
        for t in self.derived:
            if _same_float(evaluated(t.of, values[0]), first) and _same_float(evaluated(t.of, values[1]), second):
                return t.of
        return None

    def decided_alike(self, values: Values) -> bool:
        """Whether every recorded decision comes out the same for a unit with ``values``."""
        return all(_same_result(evaluated(decide, values), result) for decide, result in self.decisions)


def evaluated(of: Callable[[Values], object], values: Values) -> object:
    """``of(values)``, or ``FAILED`` where another unit's values make it fail (``1 / (1 - p)`` at ``p == 1``)."""
    try:
        return of(values)
    except (ArithmeticError, ValueError, TypeError):
        return FAILED


FAILED = object()
"""What a recorded computation gives where it fails: equal to no number."""


def _same_float(a, b) -> bool:
    return isinstance(a, float) and isinstance(b, float) and (a == b or (math.isnan(a) and math.isnan(b)))


def _same_result(a, b) -> bool:
    return type(a) is type(b) and (_same_float(a, b) if isinstance(a, float) else a == b)


def _value(x) -> float:
    return x.value if isinstance(x, Tracked) else x


def _of(x) -> Callable[[Values], float]:
    return x.of if isinstance(x, Tracked) else (lambda values: x)


def _is_number(x) -> bool:
    return isinstance(x, (int, float))


class Tracked(float):
    """A float that records what is computed from it (module docstring): ``of(values)`` computes it again from
    a unit's values of the varying attributes."""

    def __new__(cls, value: float, of: Callable[[Values], float], log: Log, unit: int):
        self = super().__new__(cls, value)
        self.value, self.of, self.log, self.unit = float(value), of, log, unit
        return self

    def _derive(self, value, of, other=None) -> float:
        if not isinstance(value, float):
            return value
        made = Tracked(value, of, self.log, _unit(self, other))
        if made.unit != MIXED:  # one unit's value made from another's: no unit's values make it again
            self.log.derived.append(made)
        return made

    def _decide(self, decide: Callable[[Values], object], result, other=None):
        if _unit(self, other) == MIXED:  # two units' values compared (a cache looking a rate up): a later unit
            decide = _never  # holds its own in both places, so it would decide otherwise
        self.log.decisions.append((decide, result))
        return result

    __hash__ = float.__hash__

    def __float__(self) -> float:  # the value leaves the record: every unit must hold the same
        return self._decide(lambda values, of=self.of: of(values), self.value)

    def __bool__(self) -> bool:
        return self._decide(lambda values, of=self.of: bool(of(values)), bool(self.value))

    def __repr__(self) -> str:
        return repr(self.value)

    __str__ = __repr__


MIXED = -1
"""The unit of a float made from two captured units' values."""


def _unit(a: Tracked, b) -> int:
    return a.unit if not isinstance(b, Tracked) or b.unit == a.unit else MIXED


def _never(values: Values) -> object:
    return _never  # equal to no result recorded


def _arithmetic(op, reflected: bool = False):
    def method(self: Tracked, other):
        if not _is_number(other):
            return NotImplemented
        a, b = (other, self) if reflected else (self, other)
        of_a, of_b = _of(a), _of(b)
        return self._derive(op(_value(a), _value(b)), lambda values: op(of_a(values), of_b(values)), other)
    return method


def _comparison(op):
    def method(self: Tracked, other):
        if not _is_number(other):
            return NotImplemented
        of_self, of_other = self.of, _of(other)
        return self._decide(lambda values: op(of_self(values), of_other(values)), op(self.value, _value(other)),
                            other)
    return method


def _unary(op, decides: bool):
    def method(self: Tracked, *args):
        of = self.of
        result = op(self.value, *args)
        if decides:  # an int (``int(p)``, ``round(p)``) decides sizes and branches
            return self._decide(lambda values: op(of(values), *args), result)
        return self._derive(result, lambda values: op(of(values), *args))
    return method


for _name, _op in (("add", operator.add), ("sub", operator.sub), ("mul", operator.mul),
                   ("truediv", operator.truediv), ("floordiv", operator.floordiv), ("mod", operator.mod),
                   ("pow", operator.pow)):
    setattr(Tracked, f"__{_name}__", _arithmetic(_op))
    setattr(Tracked, f"__r{_name}__", _arithmetic(_op, reflected=True))
for _name, _op in (("eq", operator.eq), ("ne", operator.ne), ("lt", operator.lt), ("le", operator.le),
                   ("gt", operator.gt), ("ge", operator.ge)):
    setattr(Tracked, f"__{_name}__", _comparison(_op))
for _name, _op, _decides in (("neg", operator.neg, False), ("pos", operator.pos, False), ("abs", abs, False),
                             ("int", int, True), ("trunc", math.trunc, True), ("floor", math.floor, True),
                             ("ceil", math.ceil, True), ("round", round, True)):
    setattr(Tracked, f"__{_name}__", _unary(_op, _decides))


def unit_values(blocks: list[nn.Module], keys: frozenset[Key]) -> Values:
    """One unit's values of ``keys`` (its blocks in order)."""
    return {key: _attr(blocks[key[0]], key) for key in keys}


def _attr(block: nn.Module, key: Key) -> float:
    value = getattr(block.get_submodule(key[1]), key[2])
    return value.value if isinstance(value, Tracked) else value


@contextlib.contextmanager
def tracked(units: list[list[nn.Module]], keys: frozenset[Key]) -> Iterator[Log]:
    """The attributes ``keys`` of the blocks of ``units`` replaced by tracked floats while the body traces,
    recording into the log it yields; put back afterwards."""
    log, saved = Log(), []
    try:
        for unit, blocks in enumerate(units):
            for key in keys:
                module = blocks[key[0]].get_submodule(key[1])
                value = getattr(module, key[2])
                saved.append((module, key[2], value))
                attribute = Tracked(value, lambda values, key=key: values[key], log, unit)
                log.derived.append(attribute)  # read as it is (``F.dropout(x, self.p)``)
                setattr(module, key[2], attribute)
        yield log
    finally:
        for module, name, value in reversed(saved):
            setattr(module, name, value)
