"""Rank workers for TRL's SFTTrainer on a parallel module: a peft-adapted tiny Llama trained by SFTTrainer at tp=2
against the same SFTTrainer run on the unsharded model in one process (``reference``)."""

from __future__ import annotations

import os
import tempfile

import torch

import autotp
from tests import lora_workers, models

STEPS = 3
BATCH = 2
ROWS = 8
SEQ = 12


def tokenizer():
    """A word-level tokenizer over the tiny vocabulary (token ``t{i}`` is id i), made in memory."""
    from tokenizers import Tokenizer, models as vocabularies, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(models.VOCAB)}
    made = Tokenizer(vocabularies.WordLevel(vocab, unk_token="t0"))
    made.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=made, pad_token="t0", eos_token="t1")


def dataset():
    """Pre-tokenised rows of one length (SFTTrainer then only collates them)."""
    import datasets

    ids = models.tokens(ROWS, SEQ, seed=5)
    return datasets.Dataset.from_dict({"input_ids": [row.tolist() for row in ids]})


def example() -> dict:
    """A batch as SFTTrainer's collator makes it, for the capture."""
    ids = models.tokens(BATCH, SEQ, seed=5)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}


def _trained(model, parallelism=None) -> list:
    from trl import SFTConfig, SFTTrainer

    os.environ["OMP_NUM_THREADS"] = "1"
    with tempfile.TemporaryDirectory() as folder:
        args = SFTConfig(output_dir=folder, per_device_train_batch_size=BATCH, max_steps=STEPS, learning_rate=1e-3,
                         report_to=[], save_strategy="no", logging_steps=1, use_cpu=True, seed=0,
                         dataloader_num_workers=0, disable_tqdm=True, max_length=None, max_grad_norm=0.1,
                         gradient_checkpointing=False,  # SFTConfig turns it on; a parallel module has its own (recompute)
                         bf16=False,  # SFTConfig turns on bfloat16 autocast: compared in float32 here
                         parallelism_config=parallelism, label_names=["labels"])
        trainer = SFTTrainer(model=model, args=args, train_dataset=dataset(), processing_class=tokenizer())
        trainer.train()
        return [(e.get("loss"), e.get("grad_norm")) for e in trainer.state.log_history if "loss" in e]


def reference() -> dict:
    """The adapted model's parameters after SFTTrainer's steps in one process."""
    from tests.trainer_workers import reset_accelerate

    reset_accelerate()
    model = lora_workers.adapted()
    _trained(model)
    return {k: t.detach().clone() for k, t in model.state_dict().items()}


def sharded(rank: int, world: int, folder: str) -> dict:
    """SFTTrainer's steps on the adapted model at tp=world; the largest difference from ``reference`` (saved in
    ``folder`` by the test) and how far the adapters moved."""
    from tests.trainer_workers import reset_accelerate

    reset_accelerate()
    model = lora_workers.adapted()
    start = {k: t.detach().clone() for k, t in model.state_dict().items() if "lora_" in k}
    pm = autotp.parallelize(model, tp=world, example_inputs=example(), quiet=True)
    losses = _trained(pm, autotp.parallelism_config(pm))
    want = torch.load(f"{folder}/reference.pt")
    full = pm.full_state_dict()
    return {"worst": max(float((full[k] - v).abs().max()) for k, v in want.items() if v.is_floating_point()),
            "moved": max(float((full[k] - v).abs().max()) for k, v in start.items()), "losses": losses}
