"""The ``autotp`` command, run as a user runs it: subprocesses on the example GPT and on ``hf:llama``
(started together, so their start-up overlaps), then the rest in-process through ``main``, which is what
the console script calls."""

import json
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest
import torch

import autotp
from autotp.capture.core.examples import vocab_size
from autotp.tools import cli
from autotp.tools.exports import to_hf_tp_plan
from autotp.tools.model_spec import (
    SMALL_HF,
    SpecKind,
    build_model,
    parse_overrides,
    parse_spec,
)
from tests.distributed import run_on_ranks

ROOT = Path(__file__).resolve().parents[1]
GPT = "examples/gpt.py:build_gpt"
FAKE_BENCH = "def main(argv):\n    print('bench got', argv)\n    return 3\n"


def _commands(out: Path) -> dict[str, list[str]]:
    return {
        "gpt_json": ["plan", GPT, "--tp", "2", "--format", "json", "-o", str(out / "gpt.json")],
        "llama_json": ["plan", "hf:llama", "--tp", "2", "--format", "json", "-o", str(out / "llama.json")],
        "svg": ["viz", GPT, "--tp", "2", "--vocab", "split", "-o", str(out / "gpt.svg")],
        "bad_spec": ["plan", "not-a-spec", "--tp", "2"],
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every subprocess at once (each pays torch's import), then their results by name."""
    out = tmp_path_factory.mktemp("out")
    started = {name: subprocess.Popen([sys.executable, "-m", "autotp", *args], cwd=ROOT, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE)
               for name, args in _commands(out).items()}
    results = {}
    for name, proc in started.items():
        stdout, stderr = proc.communicate(timeout=300)
        results[name] = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    return results, out


def _ok(result):
    assert result.returncode == 0, result.stderr
    return result


def _args(argv):
    return cli.build_parser().parse_args(argv)


def test_table_lists_split_modules_collectives_and_totals(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    assert cli.main(["plan", GPT, "--tp", "2", "--batch", "4", "--seq", "16", "--vocab", "split"]) == 0
    text = capsys.readouterr().out
    assert "transformer.h.[0-1].mlp.c_fc (x2)     column  [256, 64] + [256]  [128, 64] + [128]" in text
    assert "transformer.wte                       vocab   [128, 64]          [64, 64]" in text
    assert "Collectives per block (bytes at batch 4, seq 16):" in text
    # 4*16*128 floats: forward() gathers the logits; pm.step computes its loss on them split
    assert "all_gather  forward, not in step  gather           -            BxTx128  32 KiB" in text
    assert "parameter memory per rank:" in text and "communication per training step" in text


def test_json_round_trips_and_equals_planning_in_process(runs):
    results, out = runs
    _ok(results["gpt_json"])
    loaded = autotp.Plan.from_json((out / "gpt.json").read_text())
    assert loaded == cli.load_and_plan(_args(["plan", GPT, "--tp", "2"])).plan
    assert autotp.Plan.from_json(loaded.to_json()) == loaded


def _apply_saved_plan(rank, world, text):
    from examples.gpt import build_gpt

    torch.manual_seed(0)
    model = build_gpt()
    plan = autotp.Plan.from_json(text)
    ids = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(0))
    pm = autotp.parallelize(model, tp=plan.tp, example_inputs=(ids,), plan=plan)
    assert pm.plan == plan
    torch.testing.assert_close(pm(ids), model(ids), rtol=1e-5, atol=1e-6)
    return pm.plan.fingerprint()


def test_saved_plan_applies_on_two_ranks(runs):
    results, out = runs
    text = (out / "gpt.json").read_text()
    fingerprints = run_on_ranks(_apply_saved_plan, 2, text)
    assert fingerprints == [autotp.Plan.from_json(text).fingerprint()] * 2


def test_hf_model_json_and_tp_plan_export(runs, capsys):
    results, out = runs
    _ok(results["llama_json"])
    plan = autotp.Plan.from_json((out / "llama.json").read_text())
    assert plan == cli.load_and_plan(_args(["plan", "hf:llama", "--tp", "2"])).plan
    assert cli.main(["plan", "hf:llama", "--plan", str(out / "llama.json"), "--format", "hf"]) == 0
    exported = json.loads(capsys.readouterr().out)
    assert exported == to_hf_tp_plan(plan)
    import transformers
    for layer, style in transformers.LlamaConfig().base_model_tp_plan.items():
        assert exported[f"model.{layer}"] == style, layer


def test_svg_parses_and_names_every_split_module(runs):
    import xml.etree.ElementTree as ET

    from autotp.tools.report import module_rows, param_infos

    results, out = runs
    assert _ok(results["svg"]).stdout.strip() == f"wrote {out / 'gpt.svg'}"
    text = " ".join(ET.parse(out / "gpt.svg").getroot().itertext())
    planned = cli.load_and_plan(_args(["plan", GPT, "--tp", "2", "--vocab", "split"]))
    split = [r.name for r in module_rows(planned.plan, param_infos(planned.model)) if r.kind != "replicated"]
    assert len(split) == 10 and all(name in text for name in split)
    assert "vocab-split" in text and "all-reduce (g, forward)" in text


def test_png_is_a_real_picture(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    assert cli.main(["viz", GPT, "--tp", "2", "-o", str(tmp_path / "gpt.png")]) == 0
    data = (tmp_path / "gpt.png").read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 50_000
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert width > 800 and height > 1500  # a tall graph: one layer per module


def test_user_error_in_a_process_is_one_line_and_exit_2(runs):
    result = runs[0]["bad_spec"]
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
    assert result.stderr.startswith("autotp: error: MODEL 'not-a-spec' is not a model spec; use path/to/file.py")


@pytest.fixture
def isolated_bench(monkeypatch, tmp_path):
    """A working directory holding a fake bench/ package, with the repository's own bench/ out of reach."""
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".", str(ROOT))])
    tools = ("bench", "devtools", "devtools.zoo")
    saved = {name: sys.modules.pop(name) for name in tools if name in sys.modules}
    (tmp_path / "fake" / "bench").mkdir(parents=True)
    (tmp_path / "fake" / "bench" / "__init__.py").write_text(FAKE_BENCH)
    (tmp_path / "bare").mkdir()
    yield tmp_path
    for name in tools:
        sys.modules.pop(name, None)
    sys.modules.update(saved)


@pytest.mark.parametrize("command, where", [("bench", "bench/"), ("zoo", "devtools/zoo.py")])
def test_repository_tools_say_so_outside_a_checkout(isolated_bench, monkeypatch, capsys, command, where):
    """``autotp bench`` and ``autotp zoo`` run tools of the repository, which the package does not install."""
    monkeypatch.chdir(isolated_bench / "bare")
    assert cli.main([command, "--quick"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"autotp {command} is a repository tool: it runs {where}" in err
    assert "run it from the repository root" in err


def test_bench_passes_arguments_through(isolated_bench, monkeypatch, capsys):
    monkeypatch.chdir(isolated_bench / "fake")
    assert cli.main(["bench", "--quick", "x"]) == 3
    assert "bench got ['--quick', 'x']" in capsys.readouterr().out


def test_the_help_names_the_repository_tools(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    assert " ".join(capsys.readouterr().out.split()).count("A repository tool") == 2


ERRORS = [
    (["plan", "nonsense", "--tp", "2"], "is not a model spec; use path/to/file.py:factory"),
    (["plan", GPT, "--tp", "2", "--format", "xml"], "argument --format: invalid choice: 'xml'"),
    (["viz", GPT, "--tp", "2", "-o", "plan.jpg"], "cannot use the picture format from the file name 'plan.jpg'"),
    (["plan", "examples/gpt.py:build_gtp", "--tp", "2"], "examples/gpt.py does not define 'build_gtp'; it defines:"),
    (["plan", "examples/nothere.py:build", "--tp", "2"], "MODEL file 'examples/nothere.py' does not exist"),
    (["plan", "examples.nothere:build", "--tp", "2"], "cannot import module 'examples.nothere'"),
    (["plan", GPT, "--tp", "3"], "not divisible by 3; Megatron's split gives every rank an equal whole share. "
                                 "Valid tp values for this model: 1, 2, 4"),
    (["plan", GPT, "--tp", "0"], "argument --tp: must be a positive integer, got '0'"),
    (["plan", GPT], "--tp is required"),
    (["plan", GPT, "--tp", "2", "--set", "n_layer"], "--set takes name=value"),
    (["plan", GPT, "--tp", "2", "--set", "n_layers=3"], "failed: TypeError"),
    (["plan", "hf:lama", "--tp", "2"], "transformers has no model type 'lama'; did you mean llama"),
    (["plan", "hf:llama", "--tp", "2", "--set", "num_layers=3"], "has no field 'num_layers'"),
    (["viz", GPT, "--tp", "2", "--schedule", "1f1b", "-o", "t.dot"], "a timeline is a chart, not a graph"),
    (["plan", GPT, "--tp", "2", "--plan", "missing.json"], "cannot read the plan file missing.json"),
]


@pytest.mark.parametrize("argv,message", ERRORS, ids=[" ".join(a[:2]) + f" #{i}" for i, (a, _) in enumerate(ERRORS)])
def test_each_user_error_is_one_line_with_exit_2(argv, message, capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(ROOT)
    assert cli.main(argv) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("autotp: error: ") and captured.err.count("\n") == 1
    assert message in captured.err


def test_internal_errors_are_reported_as_autotp_bugs(capsys, monkeypatch):
    """An autotp invariant failing is not the user's mistake: exit 1, say it is a bug, keep the traceback."""
    def broken(*args, **kwargs):
        raise autotp.InternalError("node x no longer reads y")

    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(cli, "run_plan", broken)
    assert cli.main(["plan", GPT, "--tp", "2"]) == 1
    err = capsys.readouterr().err
    assert "internal error in autotp (a bug in autotp" in err and "node x no longer reads y" in err
    assert "Traceback" in err


def test_plan_file_is_read_and_checked(capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(ROOT)
    assert cli.main(["plan", GPT, "--tp", "2", "--vocab", "split", "--format", "json", "-o",
                     str(tmp_path / "p.json")]) == 0
    assert cli.main(["plan", GPT, "--plan", str(tmp_path / "p.json"), "--format", "hf"]) == 0
    assert json.loads(capsys.readouterr().out)["lm_head"] == "colwise_gather_output"
    assert cli.main(["plan", GPT, "--plan", str(tmp_path / "p.json"), "--tp", "4"]) == 2
    assert "was made for tp=2 but tp=4 was asked for" in capsys.readouterr().err
    assert cli.main(["viz", GPT, "--plan", str(tmp_path / "p.json"), "--schedule", "gpipe", "-o",
                     str(tmp_path / "t.html")]) == 0
    assert "bubble" in (tmp_path / "t.html").read_text()


def test_model_specs_and_overrides(monkeypatch):
    monkeypatch.chdir(ROOT)
    assert parse_spec("examples/gpt.py:build_gpt").kind is SpecKind.FILE
    assert parse_spec("examples.gpt:GPT").kind is SpecKind.MODULE
    assert parse_spec("hf:llama").kind is SpecKind.HF_TYPE
    assert parse_spec("hf:cfg/config.json").kind is SpecKind.HF_CONFIG
    overrides = (("a", 4), ("b", True), ("c", "gelu"), ("d", [1, 2]))
    assert parse_overrides(["a=4", "b=true", "c=gelu", "d=[1, 2]"]) == overrides
    gpt = build_model(parse_spec(GPT, parse_overrides(["n_layer=3"])))
    assert len(gpt.transformer.h) == 3 and vocab_size(gpt) == 128
    llama = build_model(parse_spec("hf:llama", parse_overrides(["num_hidden_layers=3"])))
    assert llama.config.num_hidden_layers == 3 and llama.config.hidden_size == SMALL_HF["hidden_size"]
    assert llama.config.head_dim == 16 and next(llama.parameters()).device.type == "meta"


def test_hf_config_file(tmp_path, monkeypatch):
    import transformers

    transformers.LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                             num_attention_heads=2, num_key_value_heads=2).save_pretrained(tmp_path)
    model = build_model(parse_spec(f"hf:{tmp_path / 'config.json'}", parse_overrides(["num_hidden_layers=2"])))
    assert model.config.vocab_size == 256 and model.config.num_hidden_layers == 2


def test_console_script_is_declared():
    (script,) = entry_points(group="console_scripts", name="autotp")
    assert script.value == "autotp.tools.cli:main"


def test_the_cli_page_shows_the_current_table_and_picture(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    page = (ROOT / "docs/cli.md").read_text()
    assert cli.main(["plan", GPT, "--tp", "2"]) == 0
    assert capsys.readouterr().out.strip() in page, "regenerate: autotp plan examples/gpt.py:build_gpt --tp 2"
    assert "autotp viz examples/gpt.py:build_gpt --tp 2 -o docs/images/gpt_tp2.png" in page
    assert (ROOT / "docs/images/gpt_tp2.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_building_a_model_leaves_the_process_as_it_found_it(monkeypatch):
    """Seeding, sys.path and the model file's module are scoped to the build."""
    monkeypatch.chdir(ROOT)
    path, modules = list(sys.path), set(sys.modules)
    torch.manual_seed(123)
    state = torch.get_rng_state()
    first = build_model(parse_spec(GPT))
    assert torch.equal(torch.get_rng_state(), state) and sys.path == path
    assert not [m for m in set(sys.modules) - modules if m.startswith("_autotp_model_")]
    again = build_model(parse_spec(GPT))  # still seeded: the same weights each time
    assert all(torch.equal(a, b) for a, b in zip(first.state_dict().values(), again.state_dict().values()))


def test_check_command_exit_codes(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    assert cli.main(["check", GPT, "--tp", "2"]) == 0
    assert capsys.readouterr().out.startswith("exact: tp=2")
    assert cli.main(["check", GPT, "--tp", "3"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("autotp: error: ") and err.count("\n") == 1


@pytest.mark.parametrize("argv, message", [
    (["plan", "hf:llama", "--tp", "2", "--set", "num_hidden_layers=abc"], "expected int, got str"),
    (["plan", "hf:llama", "--tp", "2", "--set", "num_attention_heads=3"], "not a multiple of the number of attention"),
    (["plan", GPT, "--tp", "2", "--set", "n_head=3"], "assert config.n_embd % config.n_head == 0 failed"),
])
def test_bad_settings_are_one_line(argv, message, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("autotp: error: ") and err.count("\n") == 1 and message in err, err


def test_output_suffix_picks_the_format(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    assert cli.main(["plan", GPT, "--tp", "2", "-o", str(tmp_path / "plan.json")]) == 0
    assert autotp.Plan.from_json((tmp_path / "plan.json").read_text()).tp == 2


def test_schedule_and_recompute_flags_reach_the_options(tmp_path):
    out = tmp_path / "zbv.json"
    assert cli.main(["plan", GPT, "--tp", "1", "--pp", "2", "--schedule", "zbv", "--recompute", "blocks",
                     "-o", str(out)]) == 0
    plan = autotp.Plan.from_json(out.read_text())
    assert len(plan.stages) == 4 and plan.options.schedule.value == "zbv"  # two stages per rank, in a V
    assert plan.options.recompute.value == "blocks"
