"""The benchmark runs and writes its tables (``--quick``); its pure helpers compute what they say.

No timing is asserted anywhere: timings depend on the machine and on what else runs on it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from bench.comm import megatron_minimum, totals
from bench.config import GPT2_SMALL, ModelShape, make_config
from bench.pipeline import even_split, even_split_imbalance, ideal_bubble
from bench.runtime import rotations
from bench.stats import growth_exponent, paired_ratio, summary

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SECTIONS = ["## 1. Runtime overhead", "## 2. Communication", "## 3. Memory per rank", "## 4. Preparation time",
            "## 5. Pipeline parallelism"]


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    proc = subprocess.run([sys.executable, "-m", "bench", "--quick", "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def test_quick_writes_every_section(quick_run):
    text = (quick_run / "quick-cpu-fp32.md").read_text()
    for heading in SECTIONS:
        assert heading in text, f"{heading!r} missing from the report"
    assert "| autotp / megatron |" in text


def test_quick_json_has_the_measurements(quick_run):
    results = json.loads((quick_run / "quick-cpu-fp32.json").read_text())
    assert set(results["runtime"]["times"]) >= {"autotp", "megatron", "torch_tp", "single_1t", "single_2t"}
    assert all(c["ok"] for c in results["runtime"]["checks"].values()), results["runtime"]["checks"]
    # Counts are not timings: autotp issues exactly Megatron's collectives.
    assert totals(results["runtime"]["comm"]["autotp"]) == totals(results["runtime"]["comm_minimum"])
    assert [d["layers"] for d in results["prep"]["depths"]] == [6, 12]


def test_megatron_minimum_counts_and_bytes():
    shape = ModelShape(n_layer=3, n_head=2, n_embd=8, vocab_size=32, batch=2, seq=5)
    low = megatron_minimum(shape, itemsize=4)
    assert low["forward"]["all_reduce"] == {"count": 7, "bytes": 7 * 2 * 5 * 8 * 4}
    assert low["forward"]["all_gather"] == {"count": 1, "bytes": 2 * 5 * 32 * 4}
    assert low["backward"]["all_reduce"]["count"] == 7


def test_helpers():
    assert ideal_bubble(2, 1) == 0.5 and ideal_bubble(4, 8) == 3 / 11
    assert even_split(10, 4) == [3, 3, 2, 2]
    assert even_split_imbalance(1.0, 0.0, 2.0, n_layers=4, stages=2) == pytest.approx(4 / 3)  # [2, 2 + 2]
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
