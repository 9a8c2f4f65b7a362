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

__all__ = ["Balance", "balanced_split", "brute_force", "objective"]


def _weights(compute: Sequence[float], params: Sequence[float], balance: Balance) -> list[tuple[float, float]]:
    """Per-unit (compute, params) scaled so each criterion in use sums to 1 (BOTH weighs them equally)."""
    total_c, total_p = sum(compute) or 1.0, sum(params) or 1.0
    wc = 1.0 / total_c if balance is not Balance.MEMORY else 0.0
    wp = 1.0 / total_p if balance is not Balance.COMPUTE else 0.0
    return [(c * wc, p * wp) for c, p in zip(compute, params)]


def stage_cost(units: list[tuple[float, float]], start: int, stop: int) -> float:
    """The squared (scaled) compute plus squared params of one stage holding units[start:stop]."""
    c = sum(u[0] for u in units[start:stop])
    p = sum(u[1] for u in units[start:stop])
    return c * c + p * p


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
    units = _weights(compute, params, Balance(balance))
    prefix_c, prefix_p = [0.0], [0.0]
    for c, p in units:
        prefix_c.append(prefix_c[-1] + c)
        prefix_p.append(prefix_p[-1] + p)

    def cost(i: int, j: int) -> float:
        c, p = prefix_c[j] - prefix_c[i], prefix_p[j] - prefix_p[i]
        return c * c + p * p

    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    choice = [[-1] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for k in range(1, stages + 1):
        for j in range(k, n + 1):
            for i in range(k - 1, j):
                if best[k - 1][i] < inf and _allowed(i, j, forced_set):
                    value = best[k - 1][i] + cost(i, j)
                    if value < best[k][j] - 1e-15:
                        best[k][j], choice[k][j] = value, i
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
    units = _weights(compute, params, Balance(balance))
    n, forced_set = len(units), set(forced)
    best: tuple[float, list[int]] = (float("inf"), [])
    for cuts in itertools.combinations(range(1, n), stages - 1):
        if not forced_set <= set(cuts) | {0}:
            continue
        bounds = [0, *cuts, n]
        value = sum(stage_cost(units, a, b) for a, b in zip(bounds, bounds[1:]))
        if value < best[0] - 1e-15:
            best = (value, [0, *cuts])
    return best


def objective(compute: Sequence[float], params: Sequence[float], starts: Sequence[int],
              balance: Balance = Balance.BOTH) -> float:
    """The criterion value of a given split (to compare the DP's answer with brute force)."""
    units = _weights(compute, params, Balance(balance))
    bounds = [*starts, len(units)]
    return sum(stage_cost(units, a, b) for a, b in zip(bounds, bounds[1:]))
