"""Ranks the suite starts with ``start_method="fork"`` run a backward on every torch build.

On CUDA builds of torch (2.14.1's, even with no GPU) a backward after any fake-tensor trace (every capture) starts
autograd's device threads, and a child forked after that refuses its own backward. The harness then starts fresh
interpreters instead (``bench.ranks.start_method_for``); on CPU builds it keeps forking, so ranks inherit the
suite's captures (``tests/capture_cache.py``).
"""

from __future__ import annotations

import torch

from bench import ranks
from tests.distributed import run_on_ranks


def _gradient(rank: int, world: int) -> list[float]:
    x = torch.full((2,), float(rank + 1), requires_grad=True)
    (x * x).sum().backward()
    return x.grad.tolist()


def _trace_and_backward_here() -> None:
    """What a test does before it starts ranks: a capture (torch.export's fake-tensor trace), then a backward."""
    model = torch.nn.Linear(4, 4)
    torch.export.export(model, (torch.randn(2, 4),))
    model(torch.randn(2, 4)).sum().backward()


def _cpu_build() -> bool:
    return torch.version.cuda is None and torch.version.hip is None


def test_ranks_started_for_fork_run_a_backward_after_a_trace_and_a_backward_here():
    _trace_and_backward_here()
    assert run_on_ranks(_gradient, 2) == [[2.0, 2.0], [4.0, 4.0]]


def test_ranks_are_forked_exactly_where_a_forked_child_can_run_a_backward():
    """A CPU build keeps the fork (and its inherited captures); a CUDA build, whose forked child would fail, spawns."""
    _trace_and_backward_here()
    assert ranks.fork_runs_backward() is _cpu_build()
    assert ranks.start_method_for("fork") == ("fork" if _cpu_build() else "spawn")


def test_ranks_that_cannot_be_forked_are_spawned_and_compute_the_same(monkeypatch):
    """The fallback itself, on any build: the workers are found again by name in fresh interpreters."""
    monkeypatch.setattr(ranks, "fork_runs_backward", lambda: False)
    assert ranks.start_method_for("fork") == "spawn"
    assert run_on_ranks(_gradient, 2) == [[2.0, 2.0], [4.0, 4.0]]


def test_a_start_method_other_than_fork_is_kept_without_a_probe(monkeypatch):
    def probe():
        raise AssertionError("probed")

    monkeypatch.setattr(ranks, "fork_runs_backward", probe)
    assert [ranks.start_method_for(m) for m in ("spawn", "forkserver")] == ["spawn", "forkserver"]
