"""Split a chain of units into contiguous pipeline stages, balanced by compute and/or parameters.

Minimising the variance of stage sums is the same as minimising the sum of their squares (the total
is fixed), which adds up stage by stage, so dynamic programming over the cut positions finds the
exact optimum in O(stages · units²). ``brute_force`` enumerates every split, for testing.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from autotp.errors import PlanError
from autotp.options import Balance


def _weights(compute: Sequence[float], params: Sequence[float], balance: Balance) -> list[tuple[float, float]]:
    """Per-unit (compute, params) scaled so each criterion in use sums to 1 (BOTH weighs them equally)."""
    total_c, total_p = sum(compute) or 1.0, sum(params) or 1.0
    wc = 1.0 / total_c if balance is not Balance.MEMORY else 0.0
    wp = 1.0 / total_p if balance is not Balance.COMPUTE else 0.0
    return [(c * wc, p * wp) for c, p in zip(compute, params)]


class _StageCosts:
    """The criterion of any stage units[start:stop], from prefix sums of the scaled unit costs."""

    def __init__(self, units: list[tuple[float, float]]):
        self.compute, self.params = [0.0], [0.0]
        for c, p in units:
            self.compute.append(self.compute[-1] + c)
            self.params.append(self.params[-1] + p)

    def __call__(self, start: int, stop: int) -> float:
        """The squared (scaled) compute plus squared params of one stage holding units[start:stop]."""
        c = self.compute[stop] - self.compute[start]
        p = self.params[stop] - self.params[start]
        return c * c + p * p

    def of_split(self, starts: Sequence[int]) -> float:
        """The criterion of a whole split given by its stage starts."""
        bounds = [*starts, len(self.compute) - 1]
        return sum(self(a, b) for a, b in zip(bounds, bounds[1:]))


def _allowed(start: int, stop: int, forced: frozenset[int]) -> bool:
    """A stage may not swallow a forced boundary."""
    return not any(start < f < stop for f in forced)


def balanced_split(compute: Sequence[float], params: Sequence[float], stages: int,
                   balance: Balance = Balance.BOTH, forced: Sequence[int] = ()) -> list[int]:
    """The start index of every stage (the first is 0) minimising the variance criterion.

    ``forced`` lists unit indices at which a stage must start.
    """
    n = len(compute)
    if not 1 <= stages <= n:
        raise PlanError(f"cannot make {stages} stages from {n} units")
    forced_set = frozenset(forced)
    if len(forced_set | {0}) > stages:
        raise PlanError(f"{len(forced_set)} forced cuts need at least {len(forced_set) + 1} stages, got {stages}")
    cost = _StageCosts(_weights(compute, params, Balance(balance)))
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    choice = [[-1] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    # cost(i, j) inlined over the prefix sums, and no forced-cut test without forced cuts: the inner loop runs
    # stages x units^2 / 2 times (a layout search asks for a split per profile and stage count), so its Python
    # overhead is the search's; the arithmetic and comparisons are cost's, so the split is the same.
    sums_c, sums_p = cost.compute, cost.params
    for k in range(1, stages + 1):
        prev, row, picks = best[k - 1], best[k], choice[k]
        for j in range(k, n + 1):
            top_c, top_p, least, pick = sums_c[j], sums_p[j], row[j], picks[j]
            for i in range(k - 1, j):
                if prev[i] < inf and (not forced_set or _allowed(i, j, forced_set)):
                    c, p = top_c - sums_c[i], top_p - sums_p[i]
                    value = prev[i] + (c * c + p * p)
                    if value < least - 1e-15:
                        least, pick = value, i
            row[j], picks[j] = least, pick
    if best[stages][n] == inf:
        raise PlanError(f"no split into {stages} stages honours the forced cuts at units {sorted(forced_set)}")
    starts, j = [], n
    for k in range(stages, 0, -1):
        j = choice[k][j]
        starts.append(j)
    return starts[::-1]


def brute_force(compute: Sequence[float], params: Sequence[float], stages: int,
                balance: Balance = Balance.BOTH, forced: Sequence[int] = ()) -> tuple[float, list[int]]:
    """The optimum by trying every split (for tests): (objective, stage starts)."""
    cost = _StageCosts(_weights(compute, params, Balance(balance)))
    n, forced_set = len(compute), set(forced)
    best: tuple[float, list[int]] = (float("inf"), [])
    for cuts in itertools.combinations(range(1, n), stages - 1):
        if not forced_set <= set(cuts) | {0}:
            continue
        value = cost.of_split([0, *cuts])
        if value < best[0] - 1e-15:
            best = (value, [0, *cuts])
    return best


def objective(compute: Sequence[float], params: Sequence[float], starts: Sequence[int],
              balance: Balance = Balance.BOTH) -> float:
    """The criterion value of a given split (to compare the DP's answer with brute force)."""
    return _StageCosts(_weights(compute, params, Balance(balance))).of_split(starts)
