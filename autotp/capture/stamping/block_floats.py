"""Blocks that differ only in a float attribute, stamped with each block's own value.

A vision transformer trained with stochastic depth gives each block its own drop rate (``linspace(0, rate,
depth)``: Swin, BEiT, Data2Vec-vision, DeiT III); in training the rate is a constant of the block's graph
(``x.div(1 - p)``), so no two blocks trace the same graph and none could be stamped out (``capture.repeats``).

While the two captured units are traced, each float attribute that varies along the run is replaced by a
``Tracked`` float: the same value, which records how every float computed from it by continuous arithmetic was
computed (``1 - p``) and every decision taken on it (``p == 0``, ``int(p)``, ``p // 0.25``, hashing it, formatting
it, ``float(p)``: the value pinned, every unit must hold the same). The graph holds plain numbers, so a constant of
the two units that differs is explained by a recorded computation giving the first unit's number from its values
and the second's from its own (all such computations agreeing on every unit); a stamped unit then holds that
computation of its own values, and every recorded decision must come out the same for it, or the run is not
stamped. A constant equal in both units that a recorded computation could have made, but would make otherwise for
a later unit, is not stamped either. Beyond the record's sight: ``math`` functions and C extensions read the value
without asking it, so a branch on ``math.sqrt(p)`` goes unseen (as a branch on ``layer_idx`` for a block not
captured does); where such a value reaches the graph instead, the two units' numbers differ with nothing to
explain them, and the run is not stamped.
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

    def decided_alike(self, values: Values) -> bool:
        """Whether every recorded decision comes out the same for a unit with ``values``."""
        return all(_same_result(evaluated(decide, values), result) for decide, result in self.decisions)


def evaluated(of: Callable[[Values], object], values: Values) -> object:
    """``of(values)``, or ``FAILED`` where another unit's values make it fail (``1 / (1 - p)`` at ``p == 1``)."""
    try:
        return of(values)
    except (ArithmeticError, ValueError, TypeError, RecursionError):
        return FAILED


FAILED = object()
"""What a recorded computation gives where it fails: equal to no number."""


class Ambiguous(Exception):
    """A constant that recorded computations explain for the captured units but not one way for every unit."""


class Constants:
    """Every float the log recorded, computed again from each unit's values: what explains a constant."""

    def __init__(self, log: Log, values: list[Values]):
        self._made: dict[tuple, list[tuple[tuple, Callable[[Values], float]]]] = {}
        for t in log.derived:
            numbers = tuple(evaluated(t.of, v) for v in values)
            self._made.setdefault(numbers[:2], []).append((numbers, t.of))

    def made_as(self, first: float, second: float) -> Callable[[Values], float] | None:
        """How a constant that is ``first`` in the first unit and ``second`` in the second is computed from a unit's
        values; None for a constant no computation explains (``Ambiguous`` where computations that fit the two
        units part later, or make a constant equal in both units another number later)."""
        made = self._made.get((first, second), [])
        numbers = {n for n, _ in made}
        if len(numbers) > 1 or (first == second and any(any(x != first for x in n) for n in numbers)):
            raise Ambiguous(f"{first!r} and {second!r}")
        return made[0][1] if made and first != second else None


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

    def _pinned(self) -> float:
        """The plain value, which leaves the record (a dict key, text, ``float(p)``): every unit must hold it."""
        return self._decide(lambda values, of=self.of: of(values), self.value)

    def __hash__(self) -> int:  # a set or dict lookup that misses asks nothing more
        return hash(self._pinned())

    def __float__(self) -> float:
        return self._pinned()

    def __repr__(self) -> str:
        return repr(self._pinned())

    __str__ = __repr__

    def __format__(self, spec: str) -> str:
        return format(self._pinned(), spec)

    def __reduce__(self):  # copied or pickled (a value the forward cached on a module): the plain float
        return float, (self._pinned(),)

    def __bool__(self) -> bool:
        return self._decide(lambda values, of=self.of: bool(of(values)), bool(self.value))

    def is_integer(self) -> bool:
        return self._pinned().is_integer()

    def as_integer_ratio(self) -> tuple[int, int]:
        return self._pinned().as_integer_ratio()

    def hex(self) -> str:
        return self._pinned().hex()

    def conjugate(self) -> float:
        return self._derive(self.value, self.of)

    real = property(conjugate)
    imag = property(lambda self: 0.0)


MIXED = -1
"""The unit of a float made from two captured units' values."""


def _unit(a: Tracked, b) -> int:
    return a.unit if not isinstance(b, Tracked) or b.unit == a.unit else MIXED


def _never(values: Values) -> object:
    return _never  # equal to no result recorded


def _binary(op, reflected: bool = False, decides: bool = False):
    """Arithmetic with another number, recorded as a computation; with ``decides``, as a decision: a comparison,
    or arithmetic whose result jumps (``//``, ``%``, ``divmod``)."""
    def method(self: Tracked, other):
        if not _is_number(other):
            return NotImplemented
        a, b = (other, self) if reflected else (self, other)
        of_a, of_b = _of(a), _of(b)
        again, result = (lambda values: op(of_a(values), of_b(values))), op(_value(a), _value(b))
        return self._decide(again, result, other) if decides else self._derive(result, again, other)
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
                   ("truediv", operator.truediv), ("pow", operator.pow)):
    setattr(Tracked, f"__{_name}__", _binary(_op))
    setattr(Tracked, f"__r{_name}__", _binary(_op, reflected=True))
for _name, _op in (("floordiv", operator.floordiv), ("mod", operator.mod), ("divmod", divmod)):
    setattr(Tracked, f"__{_name}__", _binary(_op, decides=True))
    setattr(Tracked, f"__r{_name}__", _binary(_op, reflected=True, decides=True))
for _name, _op in (("eq", operator.eq), ("ne", operator.ne), ("lt", operator.lt), ("le", operator.le),
                   ("gt", operator.gt), ("ge", operator.ge)):
    setattr(Tracked, f"__{_name}__", _binary(_op, decides=True))
for _name, _op, _decides in (("neg", operator.neg, False), ("pos", operator.pos, False), ("abs", abs, False),
                             ("int", int, True), ("trunc", math.trunc, True), ("floor", math.floor, True),
                             ("ceil", math.ceil, True), ("round", round, True)):
    setattr(Tracked, f"__{_name}__", _unary(_op, _decides))


def unit_values(blocks: list[nn.Module], keys: frozenset[Key]) -> Values:
    """One unit's values of ``keys`` (its blocks in order)."""
    return {key: _attr(blocks[key[0]], key) for key in keys}


def _attr(block: nn.Module, key: Key) -> float:
    return getattr(block.get_submodule(key[1]), key[2])


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
        for blocks in units:  # a value the forward cached on a module (``self.keep = 1 - self.p``): plain again
            for block in blocks:
                for module in block.modules():
                    for name, value in list(vars(module).items()):
                        if isinstance(value, Tracked):
                            setattr(module, name, value.value)
