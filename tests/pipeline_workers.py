"""Per-rank bodies of the pipeline tests: a (pp x tp) model against the unsharded original."""

from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist
from torch.testing import assert_close
from torch.utils._pytree import tree_leaves

import autotp
from autotp.runtime.data_parallel import local
from tests import models
from tests.distributed import largest_first
from tests.workers import ADAM, STEPS

BATCH, SEQ, MICRO = 8, 12, 4  # 1F1B needs microbatches >= stages; each microbatch keeps batch >= 2
LAYERS = 4


def example() -> tuple:
    """The example inputs every pipelined model is captured on."""
    return (models.tokens(2, 16, seed=1),)


def check_pipeline(name: str, tp: int, pp: int, schedule: str) -> dict:
    """Train ``name`` for STEPS AdamW steps pipelined and unsharded; loss and parameters must agree."""
    ref = models.build(name, layers=LAYERS)
    pm = autotp.parallelize(ref, tp=tp, pp=pp, example_inputs=example(), microbatches=MICRO, schedule=schedule)
    label = f"{name} tp={tp} pp={pp} {schedule}"
    x, y = models.tokens(BATCH, SEQ, seed=2), models.target_for(name, BATCH, SEQ, seed=3)
    for got, want in zip(tree_leaves(pm(x)), tree_leaves(ref(x))):
        assert_close(got, want, rtol=1e-5, atol=1e-6, msg=lambda m: f"{label} output: {m}")
    opt, ref_opt = torch.optim.AdamW(pm.parameters(), **ADAM), torch.optim.AdamW(ref.parameters(), **ADAM)
    for _ in range(STEPS):
        loss = pm.step(x, target=y, loss_fn=models.loss_fn)
        ref_loss = models.loss_fn(ref(x), y)
        ref_loss.backward()
        assert_close(loss, ref_loss.detach(), rtol=1e-5, atol=0, msg=lambda m: f"{label} loss: {m}")
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
    full = pm.full_state_dict()
    for key, want in ref.state_dict().items():
        assert_close(full[key], want, rtol=1e-5, atol=1e-5, msg=lambda m: f"{label} {key} after AdamW: {m}")
    return {"local_params": sum(local(p).numel() for p in pm.parameters()),
            "total_params": sum(p.numel() for p in ref.parameters()),
            "stages": [list(s.modules) for s in pm.plan.stages]}


def check_pipelines(rank: int, world: int, tp: int, configs: list[list[str]]) -> dict:
    """``check_pipeline`` for each (model, schedule) at tp and pp = world // tp."""
    return {f"{name}/{schedule}": check_pipeline(name, tp, world // tp, schedule) for name, schedule in configs}


def check_layouts(rank: int, world: int, layouts: list[list]) -> dict:
    """``check_pipelines`` for each [tp, pp, configs] and the input errors on 2 ranks, in one spawned group (the
    largest layouts first): {"tp=.. pp=..": results, "errors": messages}, each on the ranks that ran it."""
    jobs = [(tp * pp, f"tp={tp} pp={pp}", partial(check_pipelines, rank, tp * pp, tp, configs))
            for tp, pp, configs in layouts]
    jobs.append((2, "errors", partial(bad_pipeline_inputs, rank, 2)))
    return {key: run() for _, key, run in largest_first(jobs, lambda job: job[0])}


def bad_pipeline_inputs(rank: int, world: int) -> dict:
    """The pipeline's input errors, caught on every rank."""
    messages = {}
    model, example = models.build("gpt", layers=2), (models.tokens(2, 16, 0),)
    cases = {"world": dict(tp=2, pp=2), "microbatches": dict(tp=1, pp=2, microbatches=3),
             "too_few": dict(tp=1, pp=2, microbatches=1)}
    for key, kwargs in cases.items():
        try:
            pm = autotp.parallelize(model, example_inputs=example, **kwargs)
            pm.step(models.tokens(4, 8, 1), target=models.tokens(4, 8, 2))
        except autotp.AutotpError as e:
            messages[key] = str(e)
    dist.barrier()
    return messages
