"""transformers' Trainer and accelerate's Accelerator on a parallel module, against the same runs on the unsharded
model in one process (runtime.integrations)."""

from __future__ import annotations

import inspect

import pytest
import torch

import autotp
from autotp.capture import Signature
from autotp.runtime.integrations import HFCall, forward_signature
from tests import capture_cache, trainer_workers
from tests.distributed import run_on_ranks
from tests.inputs_workers import hf_llama

pytest.importorskip("accelerate")


@pytest.fixture(scope="module")
def warmed():
    """The Llama every rank parallelizes, captured here once before the ranks fork, on its inputs with and without
    ``num_items_in_batch``: each rank of both runs finds them captured."""
    torch.manual_seed(0)
    model, example = hf_llama(), trainer_workers.example()
    for inputs in (example, {k: v for k, v in example.items() if k != "num_items_in_batch"}):
        capture_cache.warm(model, inputs)

ERROR = 1e-5
"""Largest parameter difference after STEPS AdamW steps (the other multi-rank training tests' bound)."""


@pytest.mark.parametrize("world", [2, 4])
def test_trainer_and_accelerate_train_as_the_unsharded_model(world, warmed):
    """tp=2 (world 2) and tp=2 x dp=2 (world 4): 3 Trainer steps (num_items_in_batch honoured, over rows with
    different numbers of label tokens; also with 2 micro-batches accumulated a step) and 3 steps of accelerate's
    loop (with dp=2, also over dp_mode='replicate' replicas), all clipping gradients to a norm below theirs,
    equal the unsharded runs, and so does Trainer's evaluation loss at tp=2 (no num_items_in_batch given: pm
    passes the count giving the mean); a plain Accelerator's DDP wrap and a forward under DDP are refused saying
    what to do."""
    reference = run_on_ranks(trainer_workers.references, 1, world // 2)[0]
    for rank in run_on_ranks(trainer_workers.on_ranks, world, reference):
        print(f"world {world}:", {k: v for k, v in rank.items() if isinstance(v, float)})
        assert max(rank["trainer"], rank["accumulating"], rank["accelerate"]) < ERROR, rank
        assert world > 2 or rank["eval"] < ERROR, rank  # with replicas, evaluation batches differ from one process's
        assert rank["plain accelerator"].startswith("RuntimeSetupError: a parallel module cannot be wrapped in "
                                                    "DistributedDataParallel"), rank
        assert "parallelism_config=autotp.parallelism_config(pm)" in rank["plain accelerator"]
        assert "TrainingArguments(parallelism_config=autotp.parallelism_config(pm))" in rank["plain trainer"], rank
        assert "wrapped in DistributedDataParallel over ranks [0, 1" in rank["forward under ddp"], rank
        assert world == 2 or rank["replicate"] < ERROR, rank


def test_forward_has_the_original_signature():
    """Trainer keeps the dataset columns pm.forward names: the original model's parameters, **kwargs included."""
    model = hf_llama()
    original = inspect.signature(model.forward)
    mine = forward_signature(Signature.of(model))
    assert set(mine.parameters) == set(original.parameters)
    kinds = {name: p.kind for name, p in mine.parameters.items()}
    assert kinds["kwargs"] is inspect.Parameter.VAR_KEYWORD and kinds["input_ids"] is not inspect.Parameter.VAR_KEYWORD


def _call(kwargs, names=("input_ids",), config=None):
    return HFCall.of(kwargs, names, (torch.int64,) * len(names), config, lambda: "set pm.accepts_loss_kwargs")


def test_hugging_face_keywords_are_honoured_ignored_or_refused():
    class Config:
        use_cache, output_attentions = True, False

    assert _call({"return_dict": True, "use_cache": True, "output_attentions": False}, config=Config()).kwargs == {}
    assert _call({"use_cache": False}, config=Config()).kwargs == {}  # less cache: loss and logits unchanged
    as_tuple = _call({"return_dict": False}, config=Config())
    assert as_tuple.as_tuple and as_tuple.kwargs == {}
    with pytest.raises(autotp.InputError, match="output_attentions=True asks for other outputs"):
        _call({"output_attentions": True}, config=Config())
    with pytest.raises(autotp.InputError, match="captured without it.*accepts_loss_kwargs"):
        _call({"num_items_in_batch": torch.tensor(7)})
    items = _call({"num_items_in_batch": 7}, names=("input_ids", "num_items_in_batch")).kwargs["num_items_in_batch"]
    assert items.dtype == torch.int64 and int(items) == 7  # converted to the dtype the graph was captured with


def test_the_layout_trainer_reads_is_on_a_copy_of_the_config_and_never_written():
    from autotp.options import Options
    from autotp.runtime.integrations import rank_config

    model = hf_llama()
    config = rank_config(model.config, Options(tp=2, dp=2))
    assert (config.distributed_config.tp_size, config.distributed_config.dp_size) == (2, 2)  # what Trainer reads
    assert not hasattr(model.config, "distributed_config")  # the user's model is left as it was
    assert "distributed_config" not in config.to_json_string()  # save_pretrained and exports write the same file
