"""The planner's choice of the vocabulary split: priced by the cost model, bounded by the memory budget."""

from __future__ import annotations

import pytest

import autotp
from autotp.options import parse_bytes
from autotp.planning.machines import CPU, MACHINES, machine_for
from autotp.planning.pricing import VocabCost, vocab_verdict
from examples.gpt import build_gpt
from tests import models

IDS = (models.tokens(2, 8, 0),)


def _vocab_split(plan) -> bool:
    return plan.placements["transformer.wte.weight"].is_split


def test_sizes_parse_and_bad_ones_are_refused():
    assert parse_bytes("40GiB") == 40 * 2**30 and parse_bytes("500 MB") == 500 * 10**6
    assert parse_bytes(1024) == 1024 and parse_bytes(None) is None
    for bad in ("lots", "-1GB", 0, True, "3 parsecs"):
        with pytest.raises(autotp.InputError, match="memory_budget must be"):
            parse_bytes(bad)


def test_whole_only_when_faster_and_within_the_budget():
    slower_split = VocabCost(saved=1e-3, communication=2e-3, whole_bytes=100)
    assert vocab_verdict(slower_split, split_bytes=1000, budget=None)[0]
    assert vocab_verdict(slower_split, split_bytes=1000, budget=1100)[0]
    whole, why = vocab_verdict(slower_split, split_bytes=1000, budget=1099)
    assert not whole and "over the memory budget" in why
    assert not vocab_verdict(VocabCost(saved=3e-3, communication=2e-3, whole_bytes=0), 1000, None)[0]


def test_a_machines_collectives_and_compute_are_priced():
    assert CPU.all_reduce(0, 2) == CPU.latency and CPU.all_reduce(6e8, 2) == pytest.approx(CPU.latency + 1)
    assert CPU.all_gather(6e8, 2) == pytest.approx(CPU.latency + 0.5) and CPU.compute(5e10) == pytest.approx(1)
    assert machine_for("cpu") is MACHINES["cpu"] and MACHINES["cpu"].node is CPU


def test_a_small_vocabulary_is_kept_whole_and_a_large_one_split():
    small = autotp.plan(models.build("gpt"), tp=2, example_inputs=IDS, batch=8, seq=32)
    assert not _vocab_split(small)
    assert {"transformer.wte", "lm_head"} <= set(small.by_choice)
    assert any("kept whole by the cost model" in n and "vocab='split'" in n for n in small.notes), small.notes
    large = build_gpt(n_layer=1, n_head=4, n_embd=256, vocab_size=8192, block_size=128)
    plan = autotp.plan(large, tp=2, example_inputs=(models.tokens(2, 8, 0),), batch=4, seq=128)
    assert _vocab_split(plan) and any("vocabulary of 8192 split by the cost model" in n for n in plan.notes)


def test_the_budget_and_the_fixed_choices_override_the_timing():
    model = models.build("gpt")
    tight = autotp.plan(model, tp=2, example_inputs=IDS, memory_budget="950KiB")  # split: 916 KiB, whole: 980
    assert _vocab_split(tight) and any("over the memory budget of 0.9277 MiB" in n for n in tight.notes), tight.notes
    assert _vocab_split(autotp.plan(model, tp=2, example_inputs=IDS, vocab="split"))
    whole = autotp.plan(model, tp=2, example_inputs=IDS, vocab="whole")
    assert not _vocab_split(whole) and "lm_head" in whole.by_choice
    with pytest.raises(autotp.InputError, match="vocab must be one of"):
        autotp.plan(model, tp=2, example_inputs=IDS, vocab="half")


def test_with_a_budget_regions_whose_split_is_slower_are_kept_whole():
    model = models.build("gpt")
    short = autotp.plan(model, tp=2, example_inputs=IDS, batch=8, seq=32, memory_budget="10MiB")
    assert not any(p.is_split for p in short.placements.values())  # tiny: communication outweighs everything
    assert "transformer.h.0.mlp.c_fc" in short.by_choice
    assert any("4 of 4 regions kept whole by the cost model" in n for n in short.notes), short.notes
    long = autotp.plan(model, tp=2, example_inputs=IDS, batch=8, seq=1024, memory_budget="10MiB")
    assert long.placements["transformer.h.0.attn.c_attn.weight"].is_split  # attention's T^2 compute pays
    unlimited = autotp.plan(model, tp=2, example_inputs=IDS, batch=8, seq=32)
    assert unlimited.placements["transformer.h.0.mlp.c_fc.weight"].is_split  # no budget: regions are split
    small = autotp.plan(model, tp=2, example_inputs=IDS, batch=8, seq=32, memory_budget="950KiB")
    assert sum(p.is_split for p in small.placements.values()) > 0  # the budget forces some splits
