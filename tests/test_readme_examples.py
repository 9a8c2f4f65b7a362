"""The README's examples are true: every Python block in the README and docs/ parses, and the README's training
example, run as the README says (torchrun, 2 processes), prints the losses and gradient norms the same loop gives
on the unsharded model in one process."""

from __future__ import annotations

import ast
import contextlib
import io
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from bench.ranks import free_port

ROOT = Path(__file__).resolve().parent.parent
PARALLELIZE = "autotp.parallelize(model, tp=2, example_inputs=batch)"


def _python_blocks(path: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", path.read_text(encoding="utf-8"), flags=re.S)


def _training_example() -> str:
    """The README's first Python block: the Hugging Face model trained under torchrun."""
    block = _python_blocks(ROOT / "README.md")[0]
    assert PARALLELIZE in block and "clip_grad_norm_(pm.parameters()" in block, block
    return block


def _steps(text: str) -> list[float]:
    """Each printed step's loss and gradient norm, in order, flat."""
    pairs = re.findall(r"step \d+: loss ([\d.]+), grad norm ([\d.]+)", text)
    return [float(v) for pair in pairs for v in pair]


@pytest.mark.parametrize("page", ["README.md", *sorted(p.name for p in (ROOT / "docs").glob("*.md"))])
def test_every_python_example_parses(page):
    path = ROOT / page if page == "README.md" else ROOT / "docs" / page
    for block in _python_blocks(path):
        ast.parse(block)


def test_the_readme_training_example_trains_like_the_unsharded_model(tmp_path):
    pytest.importorskip("transformers")
    example = _training_example()
    (tmp_path / "train_llama.py").write_text(example)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                          "--master-port", str(free_port()), "train_llama.py"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    parallel = _steps(run.stdout)
    assert (tmp_path / "ckpt").is_dir() and (tmp_path / "out" / "config.json").is_file()

    # The same loop on the model itself, in this process: the example with autotp taken out.
    single = example.replace(PARALLELIZE, "model").replace("dist.get_rank() == 0", "True")
    single = "\n".join(line for line in single.splitlines() if not line.startswith("pm.save"))
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(single, "readme-example-unsharded", "exec"), {})
    reference = _steps(printed.getvalue())
    assert len(parallel) == len(reference) == 20, (run.stdout, printed.getvalue())
    assert parallel == pytest.approx(reference, abs=2e-4), (parallel, reference)
