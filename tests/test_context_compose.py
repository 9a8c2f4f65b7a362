"""Context parallelism composed with tensor and data parallelism: cp=2 x tp=2 and cp=2 x dp=2 on four real gloo
ranks (one spawn), trained against the unsharded model; the checker simulating cp x tp; what stays refused."""

from __future__ import annotations

import pytest

import autotp
from tests import capture_cache, context_compose_workers, context_workers, models
from tests.distributed import run_each_on_ranks


def test_cp_with_tp_and_with_dp_train_exactly_on_four_ranks():
    """cp=2 x tp=2 (heads and MLP split inside each rank's chunk; K/V exchanged over the cp group) on Llama, and
    cp=2 x dp=2 (FSDP replicas, each a cp group reading its own rows) on the hand-written decoder: outputs, losses,
    every gradient and every parameter after AdamW steps."""
    jobs = {"cp2 x tp2": (context_compose_workers.train_composed, "llama", {"cp": 2, "tp": 2}),
            "cp2 x dp2": (context_compose_workers.train_composed, "odd", {"cp": 2, "dp": 2})}
    for _, name, settings in jobs.values():  # captured here once, not once per rank (4 on 2 cores)
        capture_cache.warm(context_workers.build(name), models.tokens(2 * settings.get("dp", 1), 16, 1)[:2])
    for per_rank in run_each_on_ranks(4, jobs):
        for label, errors in per_rank.items():
            assert errors["output"] <= 1e-6 and errors["loss"] <= 1e-6 and errors["grad"] <= 1e-6, (label, errors)


def test_the_checker_simulates_cp_with_tp():
    report = autotp.check(context_workers.llama(), 2, models.tokens(2, 16, 1), cp=2)
    assert report.exact, str(report)
    assert report.plan.tp == 2 and report.plan.options.cp == 2


def test_the_checker_sees_a_cp_rank_of_one_tp_group_computing_the_wrong_tokens(monkeypatch):
    """Ranks are (cp, tp) with tp innermost: rank 2 is cp rank 1 of tp rank 0; told it holds cp rank 0's tokens,
    its outputs are wrong and the check says so."""
    from autotp.rewrite.comm import ThreadComm

    group = ThreadComm.group
    monkeypatch.setattr(ThreadComm, "group", lambda size, timeout=20.0: group(size, timeout))

    def wrong(modules, comms):
        modules[2].cp_positions.rank = 0

    report = autotp.check(context_workers.build("odd"), 2, models.tokens(2, 16, 1), cp=2, modules_hook=wrong)
    assert not report.exact


def test_cp_with_tp_and_dp_together_and_with_pp_are_refused_naming_them():
    with pytest.raises(autotp.InputError, match="tp=2 and dp=2 together"):
        autotp.Options(cp=2, tp=2, dp=2)
    with pytest.raises(autotp.InputError, match="pp=2"):
        autotp.Options(cp=2, pp=2)
