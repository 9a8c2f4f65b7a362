"""Rank workers for TRL's DPOTrainer on a parallel module: a peft-adapted tiny Llama trained by DPOTrainer at tp=2
against the same DPOTrainer run on the unsharded peft model in one process (``reference``)."""

from __future__ import annotations

import os
import tempfile

import torch

from tests import lora_workers, models, sft_workers

STEPS = 2
PAIRS = 2
"""Preference pairs per step: DPOTrainer's forward sees the chosen rows then the rejected ones, 2 * PAIRS rows."""
ROWS = 4
PROMPT = 4
ANSWER = 4


def _text(ids) -> str:
    return " ".join(f"t{int(i)}" for i in ids)


def dataset():
    """Preference rows of one length (prompt, chosen and rejected answers of fixed lengths), as text the word-level
    tokenizer reads: every batch DPOTrainer collates has one shape, the one the module was captured with."""
    import datasets

    ids = models.tokens(ROWS, PROMPT + 2 * ANSWER, seed=9).clamp(min=2)  # not the pad or eos token
    return datasets.Dataset.from_dict({"prompt": [_text(r[:PROMPT]) for r in ids],
                                       "chosen": [" " + _text(r[PROMPT:PROMPT + ANSWER]) for r in ids],
                                       "rejected": [" " + _text(r[PROMPT + ANSWER:]) for r in ids]})


def example() -> dict:
    """A batch as DPOTrainer passes it to the model (chosen and rejected rows, the answer's eos included)."""
    ids = models.tokens(2 * PAIRS, PROMPT + ANSWER + 1, seed=5)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}


def on_disk(folder: str):
    """``dataset()`` saved in ``folder`` and read back: the reference log-probs precomputed by the first rank are
    cached beside it, where every rank reads them (an in-memory dataset caches in each process's own temporary
    folder)."""
    import datasets

    path = f"{folder}/dpo-data"
    if not os.path.isdir(path):
        dataset().save_to_disk(path)
    return datasets.load_from_disk(path)


def trained(model, parallelism=None, precompute: bool = False, data=None, ref_model=None) -> list:
    """DPOTrainer's steps on ``model`` (over ``data``, default ``dataset()``); the logged (loss, grad_norm) of each
    step."""
    from trl import DPOConfig, DPOTrainer

    os.environ["OMP_NUM_THREADS"] = "1"
    with tempfile.TemporaryDirectory() as folder:
        args = DPOConfig(output_dir=folder, per_device_train_batch_size=PAIRS, max_steps=STEPS, learning_rate=1e-2,
                         report_to=[], save_strategy="no", logging_steps=1, use_cpu=True, seed=0,
                         dataloader_num_workers=0, disable_tqdm=True, max_grad_norm=0.1, bf16=False,
                         gradient_checkpointing=False, precompute_ref_log_probs=precompute,
                         parallelism_config=parallelism)
        trainer = DPOTrainer(model=model, ref_model=ref_model, args=args,
                             train_dataset=data if data is not None else dataset(),
                             processing_class=sft_workers.tokenizer())
        trainer.train()
        return [(e.get("loss"), e.get("grad_norm")) for e in trainer.state.log_history if "loss" in e]


def reference() -> dict:
    """The adapted model's parameters after DPOTrainer's steps in one process (peft's reference: a frozen copy of
    the adapter as it was before training)."""
    from tests.trainer_workers import reset_accelerate

    reset_accelerate()
    model = lora_workers.adapted()
    losses = trained(model)
    return {"state": {k: t.detach().clone() for k, t in model.state_dict().items() if ".default." in k},
            "losses": losses}  # not the "ref" copy DPOTrainer adds


def sharded(rank: int, world: int, folder: str) -> dict:
    """DPOTrainer's steps on the adapted model at tp=world, its reference ``pm.reference_model()`` made before
    training (frozen copies of the adapters, as peft's DPOTrainer's frozen copy of the adapter); the largest
    difference from ``reference`` (saved in ``folder`` by the test) and how far the adapters moved."""
    import autotp
    from tests.trainer_workers import reset_accelerate

    reset_accelerate()
    model = lora_workers.adapted()
    start = {k: t.detach().clone() for k, t in model.state_dict().items() if "lora_" in k}
    pm = autotp.parallelize(model, tp=world, example_inputs=example(), quiet=True)
    losses = trained(pm, autotp.parallelism_config(pm), ref_model=pm.reference_model())
    want = torch.load(f"{folder}/reference.pt")
    full = pm.full_state_dict()
    return {"worst": max(float((full[k] - v).abs().max()) for k, v in want["state"].items()),
            "moved": max(float((full[k] - v).abs().max()) for k, v in start.items()), "losses": losses,
            "want_losses": want["losses"]}
