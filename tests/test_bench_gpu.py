"""The device check (``python -m bench.gpu``) in its CPU mode: every part runs at smoke-test sizes, the two-rank
part over gloo, and the section it writes (to a temporary file, never docs/) holds figures that are exact."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("transformers")


def test_the_device_check_runs_on_the_cpu_and_writes_its_section(tmp_path):
    out, figures = tmp_path / "BENCHMARKS.md", tmp_path / "gpu.json"
    out.write_text("# Benchmarks\n\nearlier text\n")
    command = [sys.executable, "-m", "bench.gpu", "--device", "cpu", "--small", "--out", str(out), "--json",
               str(figures), "--budget", "3"]  # a busy CI machine: three times the GPU's limits
    done = subprocess.run(command, capture_output=True, text=True, timeout=1500)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    found = json.loads(figures.read_text())
    assert all(part["status"] == "ok" for part in found.values()), found
    assert all(row["verdict"] == "exact" for row in found["checker"]["rows"]), found["checker"]
    assert found["single"]["fp32"]["param_max_diff"] < 1e-5, found["single"]
    assert found["generation"]["batch_1"]["same_tokens"] and found["generation"]["batch_8"]["same_tokens"]
    for rank in ("rank0", "rank1"):
        result = found["ranks"][rank]
        assert result["fp32"]["param_max_diff"] < 1e-5, result  # torch's clipping over DTensor parameters
        # a bf16 policy at tp=2 (a custom column Function's backward under autocast): within twice the
        # unsharded model's own bf16-vs-fp32 gap, as tests/test_mixed_precision judges it
        assert result["bf16_policy"]["param_rms_diff"] < 2 * result["bf16_policy"]["unsharded_bf16_vs_fp32_rms"]
        assert result["generation"]["same_tokens"], result
    text = out.read_text()
    assert text.startswith("# Benchmarks\n\nearlier text\n") and "## Device check" in text and "CPU" in text
    # written again (as a second run writes it, without running the parts once more): replaced, not appended
    from bench import gpu

    gpu.write_section(out, gpu.section({"checker": found["checker"]}, "cpu", "python -m bench.gpu --parts checker"))
    again = out.read_text()
    assert again.startswith("# Benchmarks\n\nearlier text\n") and again.count("## Device check") == 1
    assert "--parts checker" in again and "| single |" not in again
