"""Rank workers for test_trainer: transformers' Trainer and accelerate's Accelerator on a parallel module, each
compared with the same run on the unsharded model in one process (``reference_*``, run in the test's process)."""

from __future__ import annotations

import os
import tempfile

import torch
from torch.utils.data import DataLoader, Dataset

import autotp
from tests import models
from tests.inputs_workers import hf_llama

STEPS = 3
BATCH = 2
"""Rows per data-parallel replica per step."""
LR = 1e-3


class Rows(Dataset):
    """Token rows of one length, right-padded by different amounts (labels -100 there): batches hold different
    numbers of label tokens, so normalising the loss by ``num_items_in_batch`` differs from each batch's mean."""

    def __init__(self, rows: int = 16, seq: int = 12):
        ids = models.tokens(rows, seq, seed=3)
        self.rows = []
        for i in range(rows):
            keep = seq - (3 * i) % 7
            mask = (torch.arange(seq) < keep).long()
            self.rows.append({"input_ids": ids[i].masked_fill(mask == 0, 0), "attention_mask": mask,
                              "labels": ids[i].masked_fill(mask == 0, -100)})

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


def example() -> dict:
    """The example inputs the parallel module is captured with, ``num_items_in_batch`` among them."""
    batch = torch.utils.data.default_collate([Rows()[i] for i in range(BATCH)])
    return {**batch, "num_items_in_batch": torch.tensor(1.0)}


def reset_accelerate() -> None:
    """Forget accelerate's process-wide state (a singleton, which each run makes afresh), and keep one thread per
    rank (accelerate would set two on CPU ranks: more threads than the machine's cores)."""
    from accelerate.state import AcceleratorState, GradientState, PartialState

    os.environ["OMP_NUM_THREADS"] = "1"
    AcceleratorState._reset_state(True)
    PartialState._reset_state()
    GradientState._reset_state()


def _arguments(folder: str, batch: int, **extra):
    from transformers import TrainingArguments

    return TrainingArguments(output_dir=folder, per_device_train_batch_size=batch, max_steps=STEPS,
                             learning_rate=LR, adam_epsilon=1e-6, max_grad_norm=0.0, report_to=[], save_strategy="no",
                             logging_strategy="no", use_cpu=True, seed=0, dataloader_num_workers=0,
                             disable_tqdm=True, **extra)


def _trained(model, batch: int, **extra) -> dict:
    from transformers import Trainer

    with tempfile.TemporaryDirectory() as folder:
        Trainer(model=model, args=_arguments(folder, batch, **extra), train_dataset=Rows()).train()


def reference_trainer(rank: int, world: int, dp: int, extra: dict) -> dict:
    """The unsharded model's parameters (as lists) after STEPS Trainer steps on one rank, over ``dp`` replicas'
    rows at once."""
    reset_accelerate()
    torch.manual_seed(0)
    model = hf_llama()
    _trained(model, BATCH * dp, **extra)
    return _listed(model)


def _listed(model) -> dict:
    return {name: t.detach().tolist() for name, t in model.named_parameters()}


def _largest_error(pm, reference: dict) -> float:
    full = pm.full_state_dict()
    return max(float((full[name] - torch.tensor(t)).abs().max()) for name, t in reference.items())


def trainer_on_ranks(rank: int, world: int, reference: dict, extra: dict) -> dict:
    """Trainer(model=pm) at tp=2 over ``world`` ranks (dp = world / 2): the largest parameter error."""
    reset_accelerate()
    torch.manual_seed(0)
    pm = autotp.parallelize(hf_llama(), tp=2, dp=world // 2, example_inputs=example(), quiet=True)
    _trained(pm, BATCH, parallelism_config=autotp.parallelism_config(pm), **extra)
    return {"error": _largest_error(pm, reference)}


def reference_accelerate(rank: int, world: int, dp: int) -> dict:
    """The unsharded model's parameters (as lists) after STEPS AdamW steps of an accelerate loop on one rank,
    over ``dp`` replicas' rows at once."""
    reset_accelerate()
    torch.manual_seed(0)
    model = hf_llama()
    _accelerate_loop(model, BATCH * dp, None)
    return _listed(model)


def _accelerate_loop(model, batch: int, parallelism) -> None:
    """The loop of accelerate's documentation: prepare, then forward, ``accelerator.backward``, step."""
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True, parallelism_config=parallelism)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=1e-6)
    loader = DataLoader(Rows(), batch_size=batch, shuffle=False)
    model, opt, loader = accelerator.prepare(model, opt, loader)
    for _, batch_rows in zip(range(STEPS), loader):
        loss = model(**batch_rows).loss
        accelerator.backward(loss)
        opt.step()
        opt.zero_grad()


def accelerate_on_ranks(rank: int, world: int, reference: dict) -> dict:
    """accelerate's loop on pm at tp=2 over ``world`` ranks, the Accelerator built with autotp's parallelism config;
    then a plain ``Accelerator()`` (which wraps in DDP over every rank): its refusal."""
    reset_accelerate()
    torch.manual_seed(0)
    ex = {k: v for k, v in example().items() if k != "num_items_in_batch"}
    pm = autotp.parallelize(hf_llama(), tp=2, dp=world // 2, example_inputs=ex, quiet=True)
    _accelerate_loop(pm, BATCH, autotp.parallelism_config(pm))
    result = {"error": _largest_error(pm, reference)}
    reset_accelerate()
    pm = autotp.parallelize(hf_llama(), tp=2, dp=world // 2, example_inputs=ex, quiet=True)
    try:
        _accelerate_loop(pm, BATCH, None)
    except autotp.AutotpError as e:
        result["plain"] = f"{type(e).__name__}: {e}"
    return result
