"""The examples run as a user would run them."""

import re
import subprocess
import sys
from pathlib import Path

from bench.ranks import free_port

ROOT = Path(__file__).resolve().parent.parent


def test_tp_demo_under_torchrun():
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "examples/tp_demo.py", "--steps", "2"],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert "attention  column: transformer.h.0.attn.c_attn  row: transformer.h.0.attn.c_proj" in out
    diff = float(re.search(r"max \|output difference\| vs unsharded model: (\S+)", out).group(1))
    assert diff < 1e-5, out


def test_a_group_made_before_autotp_is_freed_by_destroy_process_group():
    """No gloo run loop outlives ``destroy_process_group`` (one that did aborted the process at exit, under load),
    and no gloo thread outlives the parallel module."""
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
         "tests/teardown_script.py"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    found = sorted(re.findall(r"rank (\d): runtime imported after the group: (\w+); run loops after "
                              r"destroy_process_group: (\d+), gloo threads once the module is freed: (\d+)",
                              result.stdout))
    assert found == [("0", "True", "0", "0"), ("1", "True", "0", "0")], result.stdout + result.stderr[-3000:]


def test_train_gpt_tp2_pp2_on_four_processes():
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "examples/train_gpt.py",
         "--tp", "2", "--pp", "2", "--steps", "12", "--batch", "8", "--seq", "32"],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert "stage 1:" in out and "tokens/s" in out and "peak memory" in out
    first, last = map(float, re.search(r"loss (\S+) -> (\S+) over 12 steps", out).groups())
    assert last < first, out
