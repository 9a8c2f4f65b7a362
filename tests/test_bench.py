"""The benchmark runs and writes its tables (``--quick``); its pure helpers compute what they say.

No timing is asserted anywhere: timings depend on the machine and on what else runs on it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest
import torch

from bench import _depths
from bench.comm import megatron_minimum, totals
from bench.config import GPT2_SMALL, ModelShape, make_config
from bench.imbalance import blocks_per_stage
from bench.pipeline import efficiency, ideal_bubble, schedule_allows
from bench.pp_variants import even_cuts, even_split
from bench.runtime import rotations
from bench.stats import growth_exponent, paired_ratio, summary

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SECTIONS = ["## 1. Runtime overhead", "## 2. Communication", "## 3. Memory per rank", "## 4. Preparation time",
            "## 5. Pipeline parallelism", "### tp=2 × pp=2 against a hand-written pipeline split",
            "### GPipe and 1F1B against the ideal bubble", "### Stage imbalance: the planner against an even split"]


PREP_LAYERS = [2, 4]
"""Depths preparation is timed at: shallow, as this run checks that the benchmark runs and what it writes, not
its numbers (the quick preset's 6 and 12 layers were a quarter of its time)."""


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    command = [sys.executable, "-m", "bench", "--quick", "--repeats", "1", "--out", str(out),
               "--prep-layers", ",".join(map(str, PREP_LAYERS))]
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def test_quick_writes_every_section(quick_run):
    text = (quick_run / "quick-cpu-fp32.md").read_text()
    for heading in SECTIONS:
        assert heading in text, f"{heading!r} missing from the report"
    assert "| autotp / megatron |" in text
    assert "| autotp / megatron_pp |" in text and "| gpipe_m2 | 2 |" in text


def test_quick_json_has_the_measurements(quick_run):
    results = json.loads((quick_run / "quick-cpu-fp32.json").read_text())
    assert set(results["runtime"]["times"]) >= {"autotp", "megatron", "torch_tp", "single_1t", "single_2t"}
    assert all(c["ok"] for c in results["runtime"]["checks"].values()), results["runtime"]["checks"]
    # Counts are not timings: autotp issues exactly Megatron's collectives.
    # Training steps as Megatron trains (vocab-parallel loss): within 5% of its analytic minimum in bytes.
    autotp_bytes, low = totals(results["runtime"]["comm"]["autotp"]), totals(results["runtime"]["comm_minimum"])
    assert low["bytes"] <= autotp_bytes["bytes"] <= 1.05 * low["bytes"]
    assert totals(results["runtime"]["comm"]["megatron"]) == low
    assert [d["layers"] for d in results["prep"]["depths"]] == PREP_LAYERS


def test_quick_json_has_the_pipeline_measurements(quick_run):
    pipeline = json.loads((quick_run / "quick-cpu-fp32.json").read_text())["pipeline"]
    tp_pp, schedules = pipeline["tp_pp_runtime"], pipeline["schedules"]
    assert set(tp_pp["times"]) >= {"autotp", "megatron_pp", "megatron_pp_rebuilt"}
    # Losses are numbers, not timings: every pipeline computes the single model's loss.
    assert all(c["ok"] for c in (tp_pp["checks"] | schedules["checks"]).values())
    assert set(schedules["efficiency"]) == {"gpipe_m2", "gpipe_m4", "1f1b_m2", "1f1b_m4"}
    assert set(schedules["times"]) >= {"single", "single_mb2", "single_mb4"}
    for plans in pipeline["imbalance"]["by_pp"].values():
        assert set(plans) == {"even", "compute", "memory", "both"}
        assert plans["even"]["blocks"] == [4 / len(plans["even"]["blocks"])] * len(plans["even"]["blocks"])


def test_megatron_minimum_counts_and_bytes():
    shape = ModelShape(n_layer=3, n_head=2, n_embd=8, vocab_size=32, batch=2, seq=5)
    low = megatron_minimum(shape, itemsize=4, vocab_parallel_loss=False)
    assert low["forward"]["all_reduce"] == {"count": 7, "bytes": 7 * 2 * 5 * 8 * 4}
    assert low["forward"]["all_gather"] == {"count": 1, "bytes": 2 * 5 * 32 * 4}
    assert low["backward"]["all_reduce"]["count"] == 7
    trained = megatron_minimum(shape, itemsize=4)  # the loss's three statistics per token, no logits
    assert trained["forward"] == {"all_reduce": {"count": 10, "bytes": 7 * 2 * 5 * 8 * 4 + 3 * 2 * 5 * 4}}


def test_helpers():
    assert ideal_bubble(2, 1) == 0.5 and ideal_bubble(4, 8) == 3 / 11
    assert even_split(10, 4) == [3, 3, 2, 2]
    assert even_cuts(12, 2) == ["transformer.h.6"] and even_cuts(10, 4) == ["transformer.h.3", "transformer.h.6",
                                                                            "transformer.h.8"]
    assert schedule_allows("gpipe", 2, 1) and not schedule_allows("1f1b", 2, 1) and schedule_allows("1f1b", 2, 2)
    # Two ranks each taking 0.6 of the single rank's time: efficiency 1 / 1.2.
    assert efficiency([1.0, 2.0], [0.6, 1.2], stages=2)["median"] == pytest.approx(1 / 1.2)
    assert blocks_per_stage([["transformer.wte", "transformer.h.0", "transformer.h.1.attn"],
                             ["transformer.h.1.mlp", "transformer.h.2", "lm_head"]]) == [1.5, 1.5]
    assert rotations(["a", "b", "c"], 4) == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"], ["a", "b", "c"]]
    assert growth_exponent([6, 12, 24], [1.0, 2.0, 4.0]) == pytest.approx(1.0)
    assert growth_exponent([6, 12, 24], [1.0, 4.0, 16.0]) == pytest.approx(2.0)
    paired = paired_ratio([2.0, 4.0, 6.0], [1.0, 2.0, 3.0])  # drift shared by a round cancels
    assert paired["median"] == paired["low"] == paired["high"] == 2.0
    s = summary([3.0, 1.0, 2.0, 4.0])
    assert (s["median"], s["min"], s["max"], s["n"]) == (2.5, 1.0, 4.0, 4)


def test_config_validates():
    assert make_config(quick=False).memory == GPT2_SMALL
    with pytest.raises(ValueError, match="unknown sections"):
        make_config(quick=True, sections=("speed",))
    with pytest.raises(ValueError, match="n_head"):
        ModelShape(n_layer=1, n_head=3, n_embd=8, vocab_size=8, batch=1, seq=1)
    full = make_config(quick=False)
    assert full.schedule_microbatches == (1, 2, 4, 8) and full.schedule_shape.batch % 8 == 0
    with pytest.raises(ValueError, match="schedule_microbatches"):
        dataclasses.replace(full, schedule_microbatches=(3,))
    with pytest.raises(ValueError, match="pp_microbatches"):
        dataclasses.replace(full, pp_microbatches=1)
    assert make_config(quick=True, repeats=1, prep_layers=(2, 4)).prep_layers == (2, 4)
    assert _depths("2,4") == (2, 4) and _depths(None) is None
    with pytest.raises(ValueError, match="positive depths"):
        _depths("0,4")


def test_windowed_models_are_measured_against_their_plain_model():
    from bench.windowed import markdown

    def row(model, capture, plan, user, export):
        return {"model": model, "params": 9e6, "nodes": 1, "capture_s": capture, "plan_s": plan, "check_s": 0,
                "split_attention": 1, "attention": 1, "exact": True, "autotp_plan_s": user, "export_s": export}

    table = markdown([row("vit-matched", 0.9, 0.1, 0.5, 0.4), row("swin:image", 1.9, 0.1, 1.5, 1.1),
                      row("bert-8", 1.0, 0.0, 0.8, 0.6), row("deberta-v2-8", 2.5, 0.0, 1.2, 1.0)], 2, (1.0, 1.0))
    lines = {line.split(" | ")[0].strip("| "): line.split(" | ") for line in table.splitlines() if line.startswith("| ")}
    assert lines["swin:image"][10] == "2.00" and lines["deberta-v2-8"][10] == "2.50" and lines["vit-matched"][10] == "-"
    assert lines["swin:image"][4] == "3.00" and lines["deberta-v2-8"][4] == "1.50" and lines["vit-matched"][4] == "-"
    # the bare export against the plain model's autotp.plan: a floor where nothing can be stamped
    assert lines["swin:image"][6] == "2.20" and lines["deberta-v2-8"][6] == "1.25" and lines["vit-matched"][6] == "-"


def _sleeps(rank, world):
    import time

    time.sleep(60)
    return rank


def test_an_interrupted_run_leaves_no_rank_behind():
    """A time limit (pytest-timeout's, a signal in the caller) stops the ranks too: left running, they would hold
    the cores every later test runs on."""
    import multiprocessing
    import signal

    from tests.distributed import run_on_ranks

    def time_up(*_):
        raise TimeoutError("time up")

    previous = signal.signal(signal.SIGALRM, time_up)
    signal.alarm(3)
    try:
        with pytest.raises(TimeoutError):
            run_on_ranks(_sleeps, 2)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    assert multiprocessing.active_children() == []


def test_a_rank_past_its_time_limit_says_where_it_waited_and_fails_the_run(capfd):
    """A hung rank must not hold the suite until pytest's limit with nothing to show: past ``limit_s`` each rank
    writes its threads' stacks (here, the sleep) and exits, and the run fails naming the rank."""
    from torch.multiprocessing import ProcessExitedException

    from bench.ranks import run_on_ranks

    with pytest.raises(ProcessExitedException, match="exit code 1"):
        run_on_ranks(_sleeps, "cpu", [1, 1], start_method="fork", limit_s=3)
    assert "in _sleeps" in capfd.readouterr().err


def test_ranks_forked_after_fully_joined_threads_of_matrix_products_finish():
    from autotp.rewrite.comm import join_fully
    from bench.fork_hangs import hangs_after

    result = hangs_after(join_fully, 3)
    assert (result["rounds"], result["hung"]) == (3, 0)


def test_join_fully_returns_once_the_threads_have_left_the_os():
    import threading

    from autotp.rewrite.comm import join_fully

    threads = [threading.Thread(target=lambda: torch.randn(64, 64) @ torch.randn(64, 64)) for _ in range(4)]
    [t.start() for t in threads]
    join_fully(threads)
    assert not any(os.path.exists(f"/proc/self/task/{t.native_id}") for t in threads)
