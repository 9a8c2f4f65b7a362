"""Per-rank bodies of the training-loop tests: the loop people write, on the parallel module and on the unsharded
model, compared step by step (losses, torch's clipped norm, every parameter after)."""

from __future__ import annotations

import copy
import warnings

import torch
import torch.distributed as dist
from torch.testing import assert_close

import autotp
from bench.ranks import reform_world
from tests import models
from tests.workers import ADAM

BATCH, SEQ, MICRO, STEPS = 4, 8, 2, 3
"""Each step accumulates MICRO micro-batches of BATCH rows (every replica takes its equal slice of each)."""
MAX_NORM = 0.5
"""Below the tiny Llama's gradient norm, so clipping scales every step."""


def _batch(step: int, micro: int) -> dict:
    ids = models.tokens(BATCH, SEQ, seed=100 * step + micro)
    return {"input_ids": ids, "labels": models.tokens(BATCH, SEQ, seed=100 * step + micro + 50)}


def _rows(batch: dict, dp_rank: int, dp: int) -> dict:
    part = slice(dp_rank * BATCH // dp, (dp_rank + 1) * BATCH // dp)
    return {k: v[part] for k, v in batch.items()}


def _full(pm) -> dict:
    return {k: v for k, v in pm.full_state_dict().items() if isinstance(v, torch.Tensor)}


def _llama(kv_heads: int):
    if kv_heads == 2:
        return models.build("hf_llama", layers=2)
    import transformers

    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=models.VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=kv_heads))


def loop_trains_like_one_process(rank: int, world: int, tp: int, dp: int, mode: str, kv_heads: int = 2) -> str:
    """STEPS steps of the plain loop (accumulation over MICRO micro-batches with ``loss / MICRO``, torch's
    ``clip_grad_norm_``, AdamW, an LR scheduler, ``zero_grad``) on ``pm`` and on the unsharded model (a Llama with
    ``kv_heads`` KV heads: fewer than tp, each is a chunk several ranks hold)."""
    label = f"tp={tp} dp={dp} {mode}"
    if not reform_world(tp * dp, "cpu"):
        return label
    ref = _llama(kv_heads)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # warn_plain: a parameter left plain would clip wrongly
        pm = autotp.parallelize(copy.deepcopy(ref), tp=tp, dp=dp, dp_mode=mode, example_inputs=_batch(0, 0))
    _trains_like(pm, ref, dp, label)
    return label


def _trains_like(pm, ref, dp: int, label: str) -> None:
    """The loop on ``pm`` (its replica's rows of each batch) and on ``ref``: torch's clipped norm every step,
    every parameter after."""
    assert all(hasattr(p, "device_mesh") for p in pm.parameters()), label  # every parameter a DTensor
    opt, ref_opt = torch.optim.AdamW(pm.parameters(), **ADAM), torch.optim.AdamW(ref.parameters(), **ADAM)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=1, gamma=0.5)
    for step in range(STEPS):
        for micro in range(MICRO):
            batch = _batch(step, micro)
            (pm(**_rows(batch, pm.dp_rank, dp)).loss / MICRO).backward()
            (ref(**batch).loss / MICRO).backward()
        norm = torch.nn.utils.clip_grad_norm_(pm.parameters(), MAX_NORM)
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM)
        assert ref_norm > MAX_NORM, f"{label}: clipping must be active ({ref_norm})"
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        assert_close(norm, ref_norm, rtol=1e-5, atol=0, msg=lambda m: f"{label} step {step} norm: {m}")
        for o, s in ((opt, sched), (ref_opt, ref_sched)):
            o.step()
            s.step()
            o.zero_grad()
    got, want = _full(pm), ref.state_dict()
    for name, value in got.items():
        assert_close(value, want[name], rtol=0, atol=1e-5, msg=lambda m: f"{label} {name}: {m}")
    dist.barrier()


def shared_chunks_in_a_group(rank: int, world: int) -> str:
    """Two tp=2 modules on a 1-KV-head Llama, one per pair of ranks given as ``group=``: the KV head is a chunk
    both ranks of a pair hold, on a 2-D view made among the pair alone; the loop as above on each."""
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    ref = _llama(1)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        pm = autotp.parallelize(copy.deepcopy(ref), tp=2, example_inputs=_batch(0, 0), group=pairs[rank // 2])
    _trains_like(pm, ref, 1, f"pair {rank // 2}")
    return f"pair {rank // 2}"


def drift_is_named(rank: int, world: int) -> tuple[str, list[str]]:
    """An optimizer stepped on rank 0 only: the next forward raises DriftError on every rank, naming a replicated
    parameter; the one before it (ranks still agreeing) runs. Returns the message and the replicated parameters."""
    ref = models.build("hf_llama", layers=1)
    pm = autotp.parallelize(ref, tp=2, example_inputs=_batch(0, 0))
    opt = torch.optim.SGD(pm.parameters(), lr=0.1)
    pm(**_batch(0, 0)).loss.backward()
    if rank == 0:
        opt.step()
    try:
        pm(**_batch(1, 0))
    except autotp.errors.DriftError as e:
        return str(e), [name for name, p in pm.plan.placements.items() if not p.is_split]
    raise AssertionError("a forward after the ranks' replicated parameters drifted apart ran")


def step_accumulates_like_one_process(rank: int, world: int) -> None:
    """``pm.step(**batch, loss_scale=1/MICRO)`` over MICRO micro-batches, then an optimizer step, STEPS times, against
    the unsharded loop with ``(loss / MICRO).backward()``: losses, and every parameter after."""
    ref = models.build("hf_llama", layers=1)
    pm = autotp.parallelize(copy.deepcopy(ref), tp=2, example_inputs=_batch(0, 0))
    opt, ref_opt = torch.optim.AdamW(pm.parameters(), **ADAM), torch.optim.AdamW(ref.parameters(), **ADAM)
    for step in range(STEPS):
        for micro in range(MICRO):
            batch = _batch(step, micro)
            loss = pm.step(**batch, loss_scale=1 / MICRO)
            ref_loss = ref(**batch).loss
            (ref_loss / MICRO).backward()
            assert_close(loss, ref_loss.detach(), rtol=1e-5, atol=0)  # the unscaled loss
        opt.step(), ref_opt.step(), opt.zero_grad(), ref_opt.zero_grad()
    for name, value in _full(pm).items():
        assert_close(value, ref.state_dict()[name], rtol=0, atol=1e-5, msg=lambda m: f"{name}: {m}")


def scheduler_survives_save_and_load(rank: int, world: int, path: str) -> None:
    """A run saved mid-way with its optimizer and LR scheduler, loaded into a fresh module, optimizer and scheduler,
    continues exactly as the uninterrupted unsharded run: the learning rate and every parameter."""
    ref = models.build("hf_llama", layers=1)
    first = autotp.parallelize(copy.deepcopy(ref), tp=2, example_inputs=_batch(0, 0))
    second = autotp.parallelize(copy.deepcopy(ref), tp=2, example_inputs=_batch(0, 0))

    def make(params):
        opt = torch.optim.AdamW(params, **ADAM)
        return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))

    def train(model, opt, sched, steps):
        for step in steps:
            model(**_batch(step, 0)).loss.backward()
            opt.step(), sched.step(), opt.zero_grad()

    (opt, sched), (ref_opt, ref_sched) = make(first.parameters()), make(ref.parameters())
    train(first, opt, sched, range(2))
    first.save(path, optimizer=opt, scheduler=sched)
    opt2, sched2 = make(second.parameters())
    second.load(path, optimizer=opt2, scheduler=sched2, quiet=True)
    assert sched2.state_dict() == sched.state_dict()
    train(second, opt2, sched2, range(2, 4))
    train(ref, ref_opt, ref_sched, range(4))
    assert sched2.get_last_lr() == ref_sched.get_last_lr()
    for name, value in _full(second).items():
        assert_close(value, ref.state_dict()[name], rtol=0, atol=1e-5, msg=lambda m: f"{name}: {m}")


def fast_optimizers_train_like_one_process(rank: int, world: int) -> list[str]:
    """AdamW with ``foreach=True`` and with ``fused=True`` (the cheap ways to step DTensor parameters: one dispatch
    per op over all of them) and torch's ``clip_grad_norm_(..., foreach=True)``: STEPS steps on ``pm`` against the
    same on the unsharded model, every parameter after. One module serves both, put back to the first weights by
    ``load_state_dict`` of the unsharded model's state dict between them."""
    start = models.build("hf_llama", layers=1)
    pm = autotp.parallelize(copy.deepcopy(start), tp=2, example_inputs=_batch(0, 0))
    done = []
    for kind in ({"foreach": True}, {"fused": True}):
        ref = copy.deepcopy(start)
        pm.load_state_dict(start.state_dict())
        opt, ref_opt = torch.optim.AdamW(pm.parameters(), **ADAM, **kind), torch.optim.AdamW(ref.parameters(), **ADAM,
                                                                                               **kind)
        for step in range(STEPS):
            pm(**_batch(step, 0)).loss.backward()
            ref(**_batch(step, 0)).loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(pm.parameters(), MAX_NORM, foreach=True)
            ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM, foreach=True)
            norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
            assert_close(norm, ref_norm, rtol=1e-5, atol=0, msg=lambda m: f"{kind} step {step} norm: {m}")
            opt.step(), ref_opt.step(), opt.zero_grad(), ref_opt.zero_grad()
        for name, value in _full(pm).items():
            assert_close(value, ref.state_dict()[name], rtol=0, atol=1e-5, msg=lambda m: f"{kind} {name}: {m}")
        done.append(next(iter(kind)))
    return done
