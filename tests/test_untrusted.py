"""Files someone else wrote: plan files, optimizer state, DCP metadata and Hugging Face indexes never run code,
and each hostile or malformed one is refused with an autotp error saying what is wrong.

Each payload would create a marker file if it ran; the tests assert the marker never appears and the error's
type and message.
"""

from __future__ import annotations

import copy
import json

import pytest

import autotp
from autotp.planning.shape_expr import parse_size
from autotp.tools import cli

GPT = "examples/gpt.py:build_gpt"


def _payload(marker) -> str:
    """Python that creates ``marker`` when evaluated (as ``sympy.sympify`` would evaluate a plan's size)."""
    return f"__import__('pathlib').Path({str(marker)!r}).touch()"


@pytest.fixture(scope="module")
def gpt_plan(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("plan") / "gpt.json"
    assert cli.main(["plan", GPT, "--tp", "2", "--format", "json", "-o", str(out)]) == 0
    return json.loads(out.read_text())


def _edited(plan: dict, edit) -> dict:
    plan = copy.deepcopy(plan)
    edit(plan)
    return plan


def test_plan_sizes_are_the_size_language_the_planner_writes():
    for text, expected in [("B*T", "B*T"), ("64", "64"), ("(T//2)", "floor(T/2)"), ("B*(T - 1)", "B*(T - 1)"),
                           ("Max(1, T)", "Max(1, T)"), ("T**2", "T**2"), ("3 - T", "3 - T")]:
        assert str(parse_size(text)) == expected


def test_a_plan_size_that_is_python_never_runs(gpt_plan, tmp_path, capsys):
    marker = tmp_path / "ran"
    hostile = _edited(gpt_plan, lambda p: p["collectives"][0].update(shape=["B", _payload(marker)]))
    with pytest.raises(autotp.InputError, match=r"field plan\.collectives\[0\]\.shape\[1\] is not a size"):
        autotp.Plan.from_dict(hostile)
    # The CLI reads plan files the same way: one line on stderr, exit 2, nothing run.
    path = tmp_path / "hostile.json"
    path.write_text(json.dumps(hostile))
    assert cli.main(["plan", GPT, "--plan", str(path)]) == 2
    assert "collectives[0].shape[1] is not a size" in capsys.readouterr().err
    assert cli.main(["viz", GPT, "--plan", str(path), "-o", str(tmp_path / "p.dot")]) == 2
    for text in ["T.__class__", "9**9**9", "exec('x')", "f(T)", "lambda: 1", "T[0]", "1e5"]:
        with pytest.raises(ValueError):
            parse_size(text)
    assert not marker.exists()


@pytest.mark.parametrize("edit, message", [
    (lambda p, n: p["placements"][n].update(dim=0.0), r"placements\['{n}'\]\.dim must be a whole number, got 0\.0"),
    (lambda p, n: p["placements"][n].update(dim="0"), r"placements\['{n}'\]\.dim must be a whole number, got '0'"),
    (lambda p, n: p["placements"][n].update(segments=[-64, 256]),
     r"placements\['{n}'\]\.segments\[0\] must be at least 1, got -64"),
    (lambda p, n: p.update(tp="2"), r"field plan\.tp must be a whole number, got '2' \(str\)"),
    (lambda p, n: p["placements"][n].update(kind="colwise", dim=None),
     r"placements\['{n}'\]\.dim must be a whole number for a colwise placement, got None"),
    (lambda p, n: p["collectives"][0].update(itemsize=4.5), r"collectives\[0\]\.itemsize must be a whole number"),
    (lambda p, n: p.update(sequence_paralel=True), r"plan\.sequence_paralel is not a field here"),
])
def test_plan_fields_of_the_wrong_type_are_named(gpt_plan, edit, message):
    name = next(iter(gpt_plan["placements"]))
    with pytest.raises(autotp.InputError, match=message.format(n=name.replace(".", r"\."))) as caught:
        autotp.Plan.from_dict(_edited(gpt_plan, lambda p: edit(p, name)))
    assert "\n" not in str(caught.value)


def test_check_refuses_negative_segments_in_one_line(gpt_plan, tmp_path, capsys):
    name = next(n for n, p in gpt_plan["placements"].items() if len(p["segments"]) == 3)
    path = tmp_path / "negative.json"
    path.write_text(json.dumps(_edited(gpt_plan, lambda p: p["placements"][name].update(segments=[-64, 192, 64]))))
    assert cli.main(["check", GPT, "--tp", "2", "--plan", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and f"placements['{name}'].segments[0] must be at least 1, got -64" in err, err


def test_a_placement_built_in_code_refuses_bad_numbers():
    with pytest.raises(ValueError, match="segments must hold whole numbers of at least 1"):
        autotp.Plan(tp=2, placements={"w": autotp.planning.plan.Placement("colwise", 0, (-4, 12))})
    with pytest.raises(ValueError, match="dim must hold whole numbers"):
        autotp.planning.plan.Placement("colwise", 0.0)


# ---- Checkpoints: payloads in DCP metadata, optimizer state and indexes never run ----------------------------

class _Touch:
    """Unpickled by plain ``pickle``, this creates its marker file: a stand-in for any code a pickle can run."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.fixture(scope="module")
def solo(tmp_path_factory):
    """A tp=1 module in this process (no process group) with an AdamW state, and a folder of its checkpoints."""
    import torch

    from tests import untrusted_workers as w

    folder = tmp_path_factory.mktemp("solo")
    pm = autotp.parallelize(w.gpt(), tp=1, example_inputs=w.example(), quiet=True)
    opt = torch.optim.AdamW(pm.parameters(), **w.ADAM)
    w.train(pm, opt, w.batches()[:1])
    pm.save(folder / "dcp", optimizer=opt)
    pm.save(folder / "hf", format="safetensors")
    return pm, opt, folder


def _fresh(solo, name: str, tmp_path):
    """A copy of the solo checkpoint ``name`` to damage."""
    import shutil

    return shutil.copytree(solo[2] / name, tmp_path / name)


def test_dcp_metadata_payload_never_runs(solo, tmp_path):
    import pickle

    pm, _, _ = solo
    pickle.loads(pickle.dumps(_Touch(tmp_path / "live")))
    assert (tmp_path / "live").exists(), "the payload runs under plain pickle"
    marker, folder = tmp_path / "ran", _fresh(solo, "dcp", tmp_path)
    (folder / ".metadata").write_bytes(pickle.dumps(_Touch(marker)))
    # The manifest notices first: the file changed, and it is never unpickled.
    with pytest.raises(autotp.CheckpointError, match=r"is damaged: \.metadata has \d+ bytes where the save wrote"):
        pm.load(folder, quiet=True)
    # Unverified, the restricted unpickler refuses it; parallelize(checkpoint=) reads it the same way.
    refusal = r"holds more than torch.distributed.checkpoint metadata \((io|builtins)\.open is not part of"
    with pytest.raises(autotp.CheckpointError, match=refusal):
        pm.load(folder, quiet=True, verify=False)
    from tests import untrusted_workers as w
    with pytest.raises(autotp.CheckpointError, match=refusal):
        autotp.parallelize(w.gpt(), tp=1, example_inputs=w.example(), checkpoint=folder, verify=False, quiet=True)
    # Hidden inside real metadata (a field DCP keeps for planners): refused all the same.
    from autotp.runtime.safe_pickle import load_metadata

    metadata = load_metadata(solo[2] / "dcp" / ".metadata")
    metadata.planner_data = _Touch(marker)
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(autotp.CheckpointError, match=refusal):
        pm.load(folder, quiet=True, verify=False)
    assert not marker.exists()


def test_dcp_metadata_naming_a_file_outside_is_refused(solo, tmp_path):
    import pickle

    from autotp.runtime.safe_pickle import load_metadata

    pm, _, _ = solo
    folder = _fresh(solo, "dcp", tmp_path)
    metadata = load_metadata(folder / ".metadata")
    for info in metadata.storage_data.values():
        info.relative_path = "../outside/__0_0.distcp"
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(autotp.CheckpointError, match=r"names '\.\./outside/__0_0\.distcp', a path outside the "
                                                     r"checkpoint folder"):
        pm.load(folder, quiet=True, verify=False)


def test_optimizer_state_payload_never_runs(solo, tmp_path):
    from autotp.runtime import checkpoint, dcp

    pm, opt, _ = solo
    marker = tmp_path / "ran"
    held = pm._holding()
    state = {checkpoint.MODEL_PREFIX + n: dcp.Sharded.of(t.detach(), p) for n, (t, p) in held.tensors.items()}
    state |= checkpoint.optimizer_state(opt, held)
    key = next(k for k in state if k.startswith(checkpoint.OPTIMIZER_GROUPS))
    state[key] = dict(state[key], lr=_Touch(marker))  # what torch.load(weights_only=False) would run
    dcp.save(state, tmp_path / "hostile", None, False)
    with pytest.raises(autotp.CheckpointError, match=rf"the checkpoint's {key} holds objects other than numbers, "
                                                     r"strings, containers and tensors \((io|builtins)\.open is not "
                                                     r"allowed\); refused"):
        pm.load(tmp_path / "hostile", optimizer=opt, quiet=True)
    assert not marker.exists()


def test_hf_index_pointing_outside_the_folder_is_refused(solo, tmp_path):
    import shutil

    pm, _, folder = solo
    (tmp_path / "outside").mkdir()
    shutil.copy(folder / "hf" / "model.safetensors", tmp_path / "outside" / "x.safetensors")
    hf = tmp_path / "hf"
    hf.mkdir()
    for target in ("../outside/x.safetensors", str(tmp_path / "outside" / "x.safetensors")):
        names = json.loads(json.dumps(list(pm.full_state_dict())))
        (hf / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {n: target for n in names}}))
        with pytest.raises(autotp.CheckpointError, match=rf"names '{target}', a path outside the checkpoint folder"):
            pm.load(hf, quiet=True)
        from tests import untrusted_workers as w
        with pytest.raises(autotp.CheckpointError, match="a path outside the checkpoint folder"):
            autotp.parallelize(w.gpt(), tp=1, example_inputs=w.example(), checkpoint=hf, quiet=True)


def test_one_error_lists_shapes_dtypes_and_missing_tensors():
    import torch

    from autotp.runtime.matching import Expected, match

    expected = [Expected("w", ("w",), (4, 4), torch.float32, True),
                Expected("steps", ("steps",), (1,), torch.int64, True),
                Expected("b", ("b",), (4,), torch.float32, True),
                Expected("tied", ("tied", "head"), (4,), torch.float32, True),
                Expected("mask", ("mask",), (4,), torch.bool, False)]  # not required: a missing one is fine
    shapes = {"w": (8, 4), "steps": (1,), "head": (4,)}
    dtypes = {"w": "BF16", "steps": "F32", "head": torch.bfloat16}  # bfloat16 into float32 is a cast, not a mismatch
    with pytest.raises(autotp.CheckpointError) as caught:
        match(expected, shapes, dtypes, "checkpoint 'x'", strict=True)
    assert str(caught.value) == (
        "checkpoint 'x' does not fit the model: 1 tensor(s) of another shape: w [8, 4] (the model's: [4, 4]); "
        "1 tensor(s) of another kind of dtype: steps float32 (the model's: int64); 1 tensor(s) of the model missing: "
        "b. Build the model from the checkpoint's config, or pass this model's checkpoint. Pass strict=False to keep "
        "the model's own values for the missing tensors.")
    fine = {"w": (4, 4), "steps": (1,), "head": (4,)}
    assert match(expected, fine, {"steps": "I64"}, "x", strict=False) == {"w": "w", "steps": "steps", "tied": "head"}


def test_a_manifest_naming_a_file_outside_is_refused(solo, tmp_path):
    pm, _, _ = solo
    folder = _fresh(solo, "dcp", tmp_path)
    manifest = json.loads((folder / "autotp-manifest.json").read_text())
    manifest["files"]["../../etc/passwd"] = {"size": 1, "crc32": "00000000"}
    (folder / "autotp-manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(autotp.CheckpointError, match=r"names '\.\./\.\./etc/passwd', a path outside the checkpoint"):
        pm.load(folder, quiet=True)


# ---- Saves: atomic, and a save never deletes what is not a checkpoint ------------------------------------------

def test_a_swap_interrupted_between_its_renames_loads_the_previous_checkpoint(solo, tmp_path, monkeypatch):
    import os
    from types import SimpleNamespace

    import torch

    from autotp.runtime import staging

    pm, opt, _ = solo
    target = tmp_path / "ckpt"
    pm.save(target)
    saved = pm.full_state_dict()
    renames = []

    def second_fails(src, dst):
        renames.append(src)
        if len(renames) == 2:
            raise OSError("killed here")
        os.rename(src, dst)

    # Only the swap's renames fail (DCP renames its own files through os too).
    monkeypatch.setattr(staging, "os", SimpleNamespace(**{**vars(os), "rename": second_fails}))
    with torch.no_grad():
        next(pm.parameters()).add_(1.0)
    with pytest.raises(OSError, match="killed here"):
        pm.save(target)
    monkeypatch.undo()
    assert not target.exists() and staging.sibling(target, staging.PREVIOUS).is_dir()
    pm.load(target, quiet=True)  # the previous checkpoint, complete, stands in for it
    assert all(torch.equal(v, saved[k]) for k, v in pm.full_state_dict().items())
    pm.save(target)  # and the next save puts a checkpoint back in place
    assert target.is_dir() and not staging.sibling(target, staging.PREVIOUS).exists()


def test_a_save_refuses_to_replace_a_folder_of_other_files(solo, tmp_path):
    pm, _, _ = solo
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "train.log").write_text("epoch 1")
    with pytest.raises(autotp.CheckpointError, match=r"holds files that are not a checkpoint's \(train.log\)"):
        pm.save(tmp_path / "run")
    assert (tmp_path / "run" / "train.log").read_text() == "epoch 1"


# ---- Checkpoints damaged or of another model, on 2 gloo ranks: every rank refuses alike ------------------------

@pytest.fixture(scope="module")
def faults(tmp_path_factory):
    from tests import untrusted_workers
    from tests.distributed import run_on_ranks

    folder = tmp_path_factory.mktemp("faults")
    return run_on_ranks(untrusted_workers.faults, 2, str(folder)), folder


def _both(faults, key: str) -> str:
    """The error both ranks raised for ``key`` (asserted the same on each, as an autotp CheckpointError)."""
    messages = [r[key] for r in faults[0]]
    assert all(m.startswith("CheckpointError: ") for m in messages), messages
    return messages[0]


def test_a_bigger_models_dcp_checkpoint_is_refused_listing_every_mismatch(faults):
    for key in ("shape_dcp_load", "shape_dcp_parallelize"):
        message = _both(faults, key)
        assert faults[0][0][key] == faults[0][1][key]
        assert "does not fit the model" in message and "tensor(s) of another shape" in message, message
        assert "transformer.wte.weight [256, 128] (the model's: [128, 64])" in message, message
        assert "transformer.h.1.mlp.c_proj.weight [128, 512] (the model's: [64, 256])" in message, message
        assert "Build the model from the checkpoint's config" in message and "\n" not in message


def test_a_bigger_models_safetensors_is_refused_listing_every_mismatch(faults):
    for key in ("shape_st_load", "shape_st_parallelize"):
        message = _both(faults, key)
        assert "transformer.wte.weight [256, 128] (the model's: [128, 64])" in message, message
        assert "transformer.h.0.attn.c_attn.weight [384, 128] (the model's: [192, 64])" in message, message


def test_flipped_bytes_are_detected(faults):
    assert "__1_0.distcp does not hold the bytes the save wrote (its crc32 differs: damaged)" in _both(
        faults, "flipped_dcp")
    assert "model.safetensors does not hold the bytes the save wrote" in _both(faults, "flipped_st")


def test_a_truncated_shard_fails_every_rank(faults):
    assert "__0_0.distcp has" in _both(faults, "truncated") and "(truncated or overwritten)" in _both(
        faults, "truncated")
    # Unverified, the rank that reads the short file fails and tells the other, which refuses too.
    messages = [r["truncated_unverified"] for r in faults[0]]
    assert all(m.startswith("CheckpointError: ") for m in messages), messages
    assert all("reading the checkpoint" in m and "failed" in m and "load an earlier checkpoint" in m
               for m in messages), messages
    # So does parallelize(checkpoint=) unverified: its reads are agreed over the ranks as pm.load's are.
    messages = [r["truncated_unverified_parallelize"] for r in faults[0]]
    assert all(m.startswith("CheckpointError: ") for m in messages), messages
    assert all("reading the checkpoint" in m and "load an earlier checkpoint" in m for m in messages), messages
    # Where only one rank's read fails, the other is told and refuses too, naming it.
    assert [r["one_rank_fails"] for r in faults[0]] == [
        "CheckpointError: loading a checkpoint failed on 1 other rank(s), so no rank goes on: rank 1: "
        "CheckpointError: rank 1 read a short file", "CheckpointError: rank 1 read a short file"]


def test_a_deleted_shard_is_named(faults):
    assert "checkpoint" in _both(faults, "deleted") and "__1_0.distcp is missing" in _both(faults, "deleted")
    assert "__1_0.distcp" in _both(faults, "deleted_unverified"), _both(faults, "deleted_unverified")


def test_an_unfinished_save_is_named_as_such(faults):
    assert "a save to it did not finish" in _both(faults, "unfinished")
    assert "holds a save that did not finish" in _both(faults, "unfinished_partial")
    assert "this save did not finish" in _both(faults, "in_place")


def test_a_real_model_missing_a_tensor_is_refused_unless_not_strict(faults):
    from tests.untrusted_workers import MISSING

    for key in ("missing_parallelize", "missing_load"):
        message = _both(faults, key)
        assert f"1 tensor(s) of the model missing: {MISSING}" in message, message
        assert "Pass strict=False to keep the model's own values for the missing tensors" in message
    assert [r["strict_false"] for r in faults[0]] == ["loaded", "loaded"]


def test_a_rank_killed_mid_save_keeps_the_previous_checkpoint_and_resuming_equals_the_run(faults):
    import multiprocessing
    import socket

    from tests import untrusted_workers
    from tests.distributed import run_on_ranks

    folder = faults[1]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    spawn = multiprocessing.get_context("spawn")
    ranks = [spawn.Process(target=untrusted_workers.killed_save, args=(r, 2, port, str(folder))) for r in range(2)]
    for rank in ranks:
        rank.start()
    for rank in ranks:
        rank.join(timeout=300)
    for rank in ranks:
        if rank.is_alive():  # the survivor waits at most its 60 s timeout; never let it outlive the test
            rank.kill()
            rank.join()
    assert ranks[1].exitcode == -9, "rank 1 was killed in the middle of the save"
    assert ranks[0].exitcode != 0, "its peer died: rank 0's save cannot finish"
    assert (folder / "resume.autotp-partial").is_dir(), "the killed save wrote beside the checkpoint, not over it"
    resumed = run_on_ranks(untrusted_workers.resume, 2, str(folder))
    assert all(r["differ"] == [] and r["keys"] > 10 for r in resumed), resumed
