"""Run a function on N real gloo ranks (spawned processes) and collect each rank's JSON result.

One spawn pays the process start-up once, so a worker should check several models per call.
"""

from __future__ import annotations

import json
import os
import socket
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, fn, args: tuple, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        result = fn(rank, world, *args)
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(result, f)
    finally:
        dist.destroy_process_group()


def run_on_ranks(fn, world: int, *args) -> list:
    """``fn(rank, world, *args)`` on ``world`` gloo ranks; returns the per-rank results.

    An exception in any rank (a failed assertion included) fails the caller with that rank's traceback.
    """
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(_entry, args=(world, _free_port(), fn, args, out_dir), nprocs=world, join=True)
        results = []
        for rank in range(world):
            with open(os.path.join(out_dir, f"rank{rank}.json")) as f:
                results.append(json.load(f))
    return results
