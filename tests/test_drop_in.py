"""A parallel module as a drop-in model (tests/drop_in_workers.py): what a Hugging Face model answers, on gloo,
against the unsharded model."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from autotp.capture import capture
from autotp.errors import InputError
from autotp.runtime.hf_model import shard_bytes
from tests import capture_cache, drop_in_workers
from tests.distributed import run_on_ranks

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def warmed():
    """The Llama the workers parallelize, captured here on its two example inputs (with and without labels) before
    the ranks fork: each of the four spawns below finds them captured instead of capturing them in every rank."""
    ids = drop_in_workers._ids(1)
    for example in ({"input_ids": ids, "labels": ids}, {"input_ids": ids}):
        capture_cache.warm(drop_in_workers.small_llama(), example)


def test_a_tensor_parallel_llama_answers_like_the_model(tmp_path, warmed):
    results = run_on_ranks(drop_in_workers.drop_in_at_two, 2, str(tmp_path / "saved"))
    for rank, r in enumerate(results):
        assert r["config"] and r["generation_config"] and r["device"] == "cpu" and r["dtype"] == "torch.float32", r
        # evaluation without the labels it was captured with: the model's output without them, no loss
        assert r["eval_keys"] == ["logits"] and r["eval_logits"] < 1e-5 and r["positional"] < 1e-5, r
        assert r["eval_loss"] < 1e-5, r
        assert "labels is missing" in r["step_without_labels"], r  # a training loss still needs them
        assert r["prepared"] and r["generate"] and r["given_config"] and r["edited_config"] == 2, r
        assert r["beams"].startswith("InputError") and "num_beams=2" in r["beams"], r
        assert r["penalty"].startswith("InputError") and "repetition_penalty" in r["penalty"], r
        assert r["unknown"].startswith("InputError") and "foo" in r["unknown"], r
        assert r["refused"].startswith("InputError") and "push_to_hub" in r["refused"], r
        # state_dict: the original keys, this rank's pieces of each once; loads full and local state dicts
        assert r["keys"] and r["pieces"] and r["shard_smaller"] and r["no_mangled"], r
        assert r["full_loaded"] == 0 and r["nothing_left"] and r["output_after_load"] < 1e-5, r
        assert r["params_after_steps"] < 1e-5, r
        assert r["local_loaded"] == 0 and r["unchanged_by_refusal"] == 0, r
        assert r["missing"].startswith("CheckpointError") and "model.norm.weight" in r["missing"], r
        assert r["not_strict"] == [["model.norm.weight"], ["extra.weight"]], r
        assert r["wrong_shape"].startswith("CheckpointError") and "up_proj" in r["wrong_shape"], r
    first = results[0]
    assert first["files"] == [] and first["same_config"], first  # every file transformers writes, the same configs
    assert set(first["modes"].values()) == {first["normal_mode"]}, first
    assert first["loaded_exact"] == 0 and first["loaded_type"] == "LlamaForCausalLM", first


def test_labels_given_to_a_module_captured_without_them_are_refused(warmed):
    for r in run_on_ranks(drop_in_workers.labels_not_captured, 2):
        assert r["refused"].startswith("InputError") and "capture with labels" in r["refused"], r
        assert r["without"] < 1e-5, r


def test_state_dict_of_pipeline_stages_and_fsdp_replicas(warmed):
    results = run_on_ranks(drop_in_workers.pipeline_state, 2)
    for r in results:
        assert r["cover"] and r["split"], r
        assert r["loaded"] == 0 and r["local_loaded"] == 0 and r["eval_without_labels"] < 1e-5, r
    for r in run_on_ranks(drop_in_workers.fsdp_state, 2):
        assert r["keys"] and r["loaded"] == 0 and r["local_loaded"] == 0, r


def test_max_shard_size_reads_like_transformers():
    assert shard_bytes("5GB") == 5 * 10**9 and shard_bytes("10MiB") == 10 * 2**20 and shard_bytes(1000) == 1000
    with pytest.raises(InputError, match="max_shard_size"):
        shard_bytes("lots")


class _Tagger(nn.Module):
    """Reads input_ids through an embedding and adds labels: the two inputs play different parts."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 4)

    def forward(self, input_ids, labels):
        return self.emb(input_ids).sum(-1) + labels


def test_one_tensor_given_as_two_example_inputs_is_captured_as_two_inputs():
    """labels=input_ids in the example (the usual batch): export traced one value, and the graph read one input
    where the model reads the other, silently wrong once a call gives them different values."""
    torch.manual_seed(0)
    model, ids = _Tagger(), torch.randint(0, 10, (2, 3))
    captured = capture(model, {"input_ids": ids, "labels": ids})
    a, b = torch.randint(0, 10, (2, 3)), torch.randint(0, 10, (2, 3))
    assert torch.equal(captured.module(a, b), model(a, b))


class _NextTokenLoss(nn.Module):
    """Labels one longer than the ids (the loss reads labels[:, 1:]): a stand-in shaped like the ids cannot fit."""

    def __init__(self):
        super().__init__()
        self.emb, self.head = nn.Embedding(16, 8), nn.Linear(8, 16)

    def forward(self, input_ids, labels):
        logits = self.head(self.emb(input_ids))
        return {"loss": nn.functional.cross_entropy(logits.flatten(0, 1), labels[:, 1:].flatten()), "logits": logits}


def test_labels_that_no_stand_in_fits_are_asked_for():
    import autotp

    torch.manual_seed(0)
    model, ids = _NextTokenLoss(), torch.randint(0, 16, (2, 5))
    pm = autotp.parallelize(model, tp=1, example_inputs={"input_ids": ids, "labels": torch.randint(0, 16, (2, 6))})
    with pytest.raises(InputError, match="stand-in labels of shape \\(2, 5\\) did not fit its loss.*pass labels"):
        pm(input_ids=ids)
    labels = torch.randint(0, 16, (2, 6))
    torch.testing.assert_close(pm(input_ids=ids, labels=labels)["loss"], model(ids, labels)["loss"])


def test_a_part_of_the_model_asked_of_the_parallel_module_is_named():
    import autotp

    torch.manual_seed(0)
    model, ids = _NextTokenLoss(), torch.randint(0, 16, (2, 5))
    pm = autotp.parallelize(model, tp=1, example_inputs=(ids, torch.randint(0, 16, (2, 6))))
    with pytest.raises(autotp.ModelPartError, match="'head'.*part of the original model.*as a whole"):
        pm.head  # noqa: B018: what TRL's fused LM head reads
    assert not hasattr(pm, "emb") and getattr(pm, "head", None) is None  # still an AttributeError to hasattr
    with pytest.raises(AttributeError) as e:
        pm.no_such_thing  # noqa: B018
    assert not isinstance(e.value, autotp.ModelPartError)
    assert isinstance(pm.module, nn.Module)  # the module's own submodules answer as before
