"""What a newcomer hit first (issue 22): --help without torch, plan -o saying what it wrote, a plan table in the
user's words, and a README whose first command plans the model it then trains."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from autotp.tools import cli

ROOT = Path(__file__).resolve().parent.parent


def test_help_answers_without_importing_torch():
    code = ("import sys\nfrom autotp.tools import cli\ntry:\n    cli.main(['--help'])\nexcept SystemExit:\n    pass\n"
            "import autotp\nautotp.InputError\nprint('torch loaded:', 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True).stdout
    assert "usage: autotp" in out and out.strip().endswith("torch loaded: False"), out


def test_plan_output_says_what_it_wrote(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    path = tmp_path / "plan.json"
    assert cli.main(["plan", "examples/gpt.py:build_gpt", "--tp", "2", "-o", str(path)]) == 0
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == (f"autotp: wrote {path}: the plan file; autotp.Plan.from_json or --plan reads it "
                            "(tp=2, pp=1)\n")


def test_the_table_says_both_and_names_modules_not_graph_nodes(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    assert cli.main(["plan", "hf:llama", "--tp", "2", "--pp", "2", "--sequence-parallel"]) == 0
    table = capsys.readouterr().out
    assert "balanced for both)" in table and "Balance." not in table
    # top-level collectives are named by their module: the head (its weight's gradient all-reduced, as it computes
    # on each rank's part of the sequence) and the final norm's
    assert "\nlm_head " in table and "\nmodel.norm " in table
    assert "slice_" not in table and "model_model_" not in table


def test_the_readme_plans_the_model_it_trains():
    readme = (ROOT / "README.md").read_text()
    assert "autotp plan examples/train_gpt.py:build_model --tp 2 --pp 2" in readme
    assert "torchrun --nproc-per-node 4 examples/train_gpt.py --tp 2 --pp 2" in readme
    assert 'pip install -e ".[hf]"' in readme
    source = (ROOT / "examples/train_gpt.py").read_text()
    assert "model = build_model(args.tp, args.seq)" in source  # the script trains what the factory builds
