"""Per-rank bodies of the peer tests: one batch per tensor-parallel group, and failures bounded and named.

``inputs_on_ranks`` runs under ``tests/distributed.py``'s harness. A failure scenario breaks its group, so
``spawn_worlds`` runs each in a world of its own (all at once: the ranks mostly wait) and returns what every
rank wrote before it exited, or None for a rank that never did (the one that hung or was killed).
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import autotp
from bench.ranks import free_port
from tests import models


def _error(call) -> str:
    """``call()``'s error as 'Type: message' ('no error' if it returned)."""
    try:
        call()
    except Exception as e:  # the test asserts on the type and message
        return f"{type(e).__name__}: {e}"
    return "no error"


def inputs_on_ranks(rank: int, world: int) -> dict:
    """tp=2 with the vocabulary split: equal batches are exact; differing ones, sizes, targets, out-of-range ids
    and an empty batch are refused on every rank, and the group still works afterwards; then pp=2 alike."""
    model = models.build("gpt")
    x, y = models.tokens(4, 16, 1), models.tokens(4, 16, 2)
    pm = autotp.parallelize(model, tp=world, example_inputs=(x,), vocab="split", quiet=True)
    out = {"exact": float((pm(x) - model(x)).detach().abs().max())}
    out["values"] = _error(lambda: pm(models.tokens(4, 16, 10 + rank)))
    out["batch"] = _error(lambda: pm(models.tokens(2 + 2 * rank, 16, 1)))
    out["target"] = _error(lambda: pm.step(x, target=models.tokens(4, 16, 20 + rank)))
    out["high"] = _error(lambda: pm(x.clamp(max=0) + models.VOCAB))
    out["negative"] = _error(lambda: pm(x - 200))
    out["empty"] = _error(lambda: pm.step(x[:0], target=y[:0]))
    out["after"] = float((pm(x) - model(x)).detach().abs().max())  # every refusal left the group in step
    # pp=2: the first stage reads the inputs, the last the target; both ranks must hold the same batch.
    piped = autotp.parallelize(model, tp=1, pp=world, example_inputs=(x,), quiet=True)
    out["pp_batch"] = _error(lambda: piped.step(models.tokens(2 + 2 * rank, 16, 1), target=y[:2 + 2 * rank]))
    out["pp_target"] = _error(lambda: piped.step(x, target=models.tokens(4, 16, 20 + rank)))
    out["pp_after"] = float((piped(x) - model(x)).detach().abs().max())
    return out


def _entry(rank: int, world: int, port: int, layout: dict, mode: str, timeout: float, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    # The group's own timeout is long: only parallelize(timeout=) can bound the wait.
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=300))
    model = models.build("gpt")
    x, y = models.tokens(4, 16, 1), models.tokens(4, 16, 2)
    pm = autotp.parallelize(model, example_inputs=(x,), timeout=timeout, quiet=True, **layout)
    pm.step(x, target=y)  # one good step: every rank has begun one call
    if rank == world - 1:
        if mode == "hang":
            time.sleep(3600)
        if mode == "kill":
            os._exit(9)
        if mode == "raise":
            x = x + 1000  # its own mistake: an InputError on this rank alone
    start = time.monotonic()
    error = _error(lambda: pm.step(x, target=y))
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"error": error, "seconds": time.monotonic() - start}, f)
    os._exit(0)  # gloo's teardown with a dead peer may block: the result is written


def spawn_worlds(scenarios: list[tuple[dict, str, int]], timeout: float, limit: float = 240.0) -> list[list]:
    """Run each (layout, mode, world) scenario in its own gloo world, all at once; per scenario, each rank's
    result (None where the rank wrote none). A rank still running after ``limit`` seconds is terminated."""
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as root:
        procs, hung = [], []
        for s, (layout, mode, world) in enumerate(scenarios):
            out = os.path.join(root, str(s))
            os.makedirs(out)
            port = free_port()
            procs += [ctx.Process(target=_entry, args=(r, world, port, layout, mode, timeout, out))
                      for r in range(world)]
            if mode == "hang":
                hung.append(procs[-1])
        for p in procs:
            p.start()
        deadline = time.monotonic() + limit
        for p in procs:
            if p not in hung:
                p.join(max(1.0, deadline - time.monotonic()))
        for p in procs:
            if p.is_alive():  # the hung ranks (their peers are done), or any past the limit
                p.kill()
                p.join()
        results = []
        for s, (_, _, world) in enumerate(scenarios):
            files = [os.path.join(root, str(s), f"rank{r}.json") for r in range(world)]
            results.append([json.load(open(f)) if os.path.exists(f) else None for f in files])
    return results
