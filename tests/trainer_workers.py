"""Rank workers for test_trainer: transformers' Trainer and accelerate's Accelerator on a parallel module, each
compared with the same run on the unsharded model in one process (``reference_*``, run in the test's process)."""

from __future__ import annotations

import functools
import os
import tempfile

import types

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset

import autotp
from tests import models
from tests.inputs_workers import hf_llama

STEPS = 3
BATCH = 2
"""Rows per data-parallel replica per step."""
LR = 1e-3
CLIP = 0.1
"""The gradient norm both runs clip to (Trainer's max_grad_norm; accelerator.clip_grad_norm_ in accelerate's loop):
below these batches' norms, so every step clips, by the global norm over the shards and replicas."""


class Rows(Dataset):
    """Token rows of one length, right-padded by different amounts (labels -100 there): batches hold different
    numbers of label tokens, so normalising the loss by ``num_items_in_batch`` differs from each batch's mean.
    Unpadded (``padded=False``), every slice holds as many, and the mean of the replicas' mean losses is the global
    batch's mean: what a loop without ``num_items_in_batch`` (accelerate's) needs to equal one process's."""

    def __init__(self, rows: int = 16, seq: int = 12, padded: bool = True, extra: bool = False):
        ids = models.tokens(rows, seq, seed=3)
        self.rows = []
        for i in range(rows):
            keep = seq - (3 * i) % 7 if padded else seq
            mask = (torch.arange(seq) < keep).long()
            row = {"input_ids": ids[i].masked_fill(mask == 0, 0), "attention_mask": mask,
                   "labels": ids[i].masked_fill(mask == 0, -100)}
            # A column the model does not take: Trainer drops it, reading the forward's signature
            self.rows.append({**row, "row": torch.tensor(i)} if extra else row)

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
                             learning_rate=LR, adam_epsilon=1e-6, max_grad_norm=CLIP, report_to=[], save_strategy="no",
                             logging_strategy="no", use_cpu=True, seed=0, dataloader_num_workers=0,
                             disable_tqdm=True, **extra)


def _trained(model, batch: int, **extra) -> float:
    """STEPS Trainer steps on ``model``; then the evaluation loss of the trained model on the same rows."""
    from transformers import Trainer

    with tempfile.TemporaryDirectory() as folder:
        # label_names: Trainer finds a model's labels in its class's forward, and pm's class takes any inputs
        trainer = Trainer(model=model, args=_arguments(folder, batch, label_names=["labels"], **extra),
                          train_dataset=Rows(extra=True), eval_dataset=Rows(extra=True))
        trainer.train()
        return trainer.evaluate()["eval_loss"]


def references(rank: int, world: int, dp: int) -> dict:
    """The unsharded model's parameters (as lists) after STEPS steps on one rank, each step on ``dp`` replicas'
    rows at once: under Trainer, and under accelerate's loop."""
    result = {}
    accumulating = functools.partial(_trained, gradient_accumulation_steps=2)
    for name, train in (("trainer", _trained), ("accumulating", accumulating), ("accelerate", _accelerate_loop)):
        reset_accelerate()
        torch.manual_seed(0)
        model = hf_llama()
        result[f"{name} eval"] = train(model, BATCH * dp)
        result[name] = {key: t.detach().tolist() for key, t in model.named_parameters()}
    return result


def _largest_error(pm, reference: dict) -> float:
    full = pm.full_state_dict()
    return max(float((full[name] - torch.tensor(t)).abs().max()) for name, t in reference.items())


def _accelerate_loop(model, batch: int, parallelism=None) -> None:
    """The loop of accelerate's documentation: prepare, then forward, ``accelerator.backward``, clip, step."""
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True, parallelism_config=parallelism)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=1e-6)
    loader = DataLoader(Rows(padded=False), batch_size=batch, shuffle=True, generator=torch.Generator().manual_seed(0))
    model, opt, loader = accelerator.prepare(model, opt, loader)
    for _, rows in zip(range(STEPS), loader):
        accelerator.backward(model(**rows).loss)
        accelerator.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()


def _refused(run) -> str:
    try:
        run()
    except autotp.AutotpError as e:
        return f"{type(e).__name__}: {e}"
    return "not refused"


def _forward_as_if_under_ddp(pm) -> None:
    """pm's forward as DistributedDataParallel over every rank runs it (what the forward's check looks for, should
    a torch release build DDP without asking pm first)."""
    from torch.nn.parallel import DistributedDataParallel

    DistributedDataParallel._active_ddp_module = types.SimpleNamespace(process_group=dist.group.WORLD)
    try:
        pm(**{k: v for k, v in example().items() if k != "num_items_in_batch"})
    finally:
        DistributedDataParallel._active_ddp_module = None


def on_ranks(rank: int, world: int, reference: dict) -> dict:
    """At tp=2 over ``world`` ranks (dp = world / 2, dp_mode fsdp): Trainer(model=pm) (also accumulating two
    micro-batches a step) and accelerate's loop, each clipping gradients (``CLIP``), each one's largest parameter
    error, and with replicas accelerate's loop over dp_mode='replicate' replicas too (averaged at the end of each
    backward); then what is refused: a plain Accelerator (it wraps pm in DDP over every rank), a forward under
    DDP."""
    def parallel(items: bool = False, **settings):
        reset_accelerate()
        torch.manual_seed(0)
        ex = example() if items else {k: v for k, v in example().items() if k != "num_items_in_batch"}
        return autotp.parallelize(hf_llama(), tp=2, dp=world // 2, example_inputs=ex, quiet=True, **settings)

    pm = parallel(items=True)
    evaluated = _trained(pm, BATCH, parallelism_config=autotp.parallelism_config(pm))
    result = {"trainer": _largest_error(pm, reference["trainer"]),
              "eval": abs(evaluated - reference["trainer eval"])}
    pm = parallel(items=True)
    _trained(pm, BATCH, parallelism_config=autotp.parallelism_config(pm), gradient_accumulation_steps=2)
    result["accumulating"] = _largest_error(pm, reference["accumulating"])
    pm = parallel()
    _accelerate_loop(pm, BATCH, autotp.parallelism_config(pm))
    result["accelerate"] = _largest_error(pm, reference["accelerate"])
    pm = parallel(items=True)
    result["plain trainer"] = _refused(lambda: _trained(pm, BATCH))  # on CPU ranks: needs the config given
    pm = parallel()
    result["plain accelerator"] = _refused(lambda: _accelerate_loop(pm, BATCH))
    result["forward under ddp"] = _refused(lambda: _forward_as_if_under_ddp(pm))
    if world > 2:
        pm = parallel(dp_mode="replicate")
        _accelerate_loop(pm, BATCH, autotp.parallelism_config(pm))
        result["replicate"] = _largest_error(pm, reference["accelerate"])
    return result
