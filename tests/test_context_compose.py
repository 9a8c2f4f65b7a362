"""Context parallelism composed with tensor, data and pipeline parallelism and recompute: cp=2 x tp=2, x dp=2 and
x pp=2 on four real gloo ranks (one spawn; eight ranks for three axes under ``-m slow``), trained against the
unsharded model; the checker simulating cp x tp and recompute; what stays refused."""

from __future__ import annotations

import pytest

import autotp
from tests import capture_cache, context_compose_workers, context_workers, models
from tests.distributed import run_each_on_ranks


def test_cp_with_tp_dp_and_pp_train_exactly_on_four_ranks():
    """cp=2 x tp=2 (heads and MLP split inside each rank's chunk; K/V exchanged over the cp group) on Llama with
    every block recomputed in backward (its exchanges run again),
    cp=2 x dp=2 (FSDP replicas, each a cp group reading its own rows) and cp=2 x pp=2 (each stage on its rank's
    chunks, the hidden state sent between stages split) on the hand-written decoder: outputs, losses, every
    gradient, the gradient norm and every parameter after AdamW steps."""
    recomputed = {"cp": 2, "tp": 2, "recompute": "blocks"}
    jobs = {"cp2 x tp2": (context_compose_workers.train_composed, "llama", recomputed),
            "cp2 x dp2": (context_compose_workers.train_composed, "odd", {"cp": 2, "dp": 2}),
            "cp2 x pp2": (context_compose_workers.train_composed, "odd", {"cp": 2, "pp": 2})}
    for _, name, settings in jobs.values():  # captured here once, not once per rank (4 on 2 cores)
        capture_cache.warm(context_workers.build(name), models.tokens(2 * settings.get("dp", 1), 16, 1)[:2])
    _exact(run_each_on_ranks(4, jobs))


def _exact(per_rank: list[dict]) -> None:
    for errors_of in per_rank:
        for label, errors in errors_of.items():  # the loss (about 5.5) within 2e-6 of its size, as the workers check
            assert errors["output"] <= 1e-6 and errors["loss"] <= 1e-5 and errors["grad"] <= 1e-6, (label, errors)


@pytest.mark.slow
def test_cp_with_pp_sums_a_weight_tied_across_stages():
    """OPT's embedding and head, tied, on the first and last of two stages at cp=2: their gradients are summed
    over the cp ranks on each stage, then over the stages, as the unsharded model's."""
    _exact(run_each_on_ranks(4, {"cp2 x pp2 OPT": (context_compose_workers.train_composed, "opt",
                                                   {"cp": 2, "pp": 2}, False)}))


@pytest.mark.slow
def test_cp_with_tp_and_dp_together_trains_exactly_on_eight_ranks():
    """cp=2 x tp=2 x dp=2 on Llama (FSDP over the tp shards, each replica a cp group): outputs, losses, every
    gradient, the gradient norm and every parameter after AdamW steps against the unsharded model on the whole
    batch."""
    _exact(run_each_on_ranks(8, {"cp2 x tp2 x dp2": (context_compose_workers.train_composed, "llama",
                                                     {"cp": 2, "tp": 2, "dp": 2})}))


@pytest.mark.slow
def test_cp_with_pp_and_tp_or_dp_trains_exactly_on_eight_ranks():
    """cp=2 x pp=2 x tp=2 on Llama, and cp=2 x pp=2 x dp=2 with every block recomputed on the hand-written
    decoder, the same way."""
    jobs = {"cp2 x pp2 x tp2": (context_compose_workers.train_composed, "llama", {"cp": 2, "pp": 2, "tp": 2}),
            "cp2 x pp2 x dp2 recompute": (context_compose_workers.train_composed, "odd",
                                          {"cp": 2, "pp": 2, "dp": 2, "recompute": "blocks"})}
    _exact(run_each_on_ranks(8, jobs))


def test_the_checker_simulates_cp_with_tp():
    report = autotp.check(context_workers.llama(), 2, models.tokens(2, 16, 1), cp=2)
    assert report.exact, str(report)
    assert report.plan.tp == 2 and report.plan.options.cp == 2


def test_the_checker_simulates_cp_with_recompute_by_each_exchange():
    """Blocks of the rewritten graph recompute in backward, running their exchange again (the ring's and Ulysses'
    own backward inside the recompute): exact, and every rank's graph has recomputed blocks."""
    blocks = []

    def count(modules, comms):
        blocks.extend(sum(n.startswith("autotp_recompute_") for n, _ in m.named_children()) for m in modules)

    for exchange in ("ring", "ulysses"):
        report = autotp.check(context_workers.llama(), 1, models.tokens(2, 16, 1), cp=2, recompute="blocks",
                              cp_exchange=exchange, modules_hook=count)
        assert report.exact, (exchange, str(report))
    assert len(blocks) == 4 and min(blocks) > 0, blocks


def test_the_checker_sees_a_cp_rank_of_one_tp_group_computing_the_wrong_tokens(monkeypatch):
    """Ranks are (cp, tp) with tp innermost: rank 2 is cp rank 1 of tp rank 0; told it holds cp rank 0's tokens,
    its outputs are wrong and the check says so."""
    report = context_workers.wrong_positions_report(monkeypatch, tp=2, rank=2)
    assert not report.exact
