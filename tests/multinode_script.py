"""One "node" of the multi-node test: run under torchrun with --nnodes 2 (tests/test_multinode.py starts two).

tp=2 x dp=2 (fsdp) over 2 nodes of 2 processes: the tensor-parallel pairs must stay within a node (consecutive
ranks), and two AdamW steps on the replicas' slices must equal one process's steps on the whole batch.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.testing import assert_close

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import autotp  # noqa: E402
from tests import models  # noqa: E402
from tests.workers import ADAM  # noqa: E402

BATCH, SEQ, STEPS = 4, 8, 2


def main() -> None:
    torch.set_num_threads(1)
    ref = models.build("gpt", layers=1)
    pm = autotp.parallelize(ref, tp=2, dp=2, example_inputs=(models.tokens(2, 8, seed=1),))  # group from torchrun
    nodes: list = [None] * dist.get_world_size()
    dist.all_gather_object(nodes, os.environ["GROUP_RANK"])  # the node torchrun's rendezvous gave each rank
    rank = dist.get_rank()
    assert nodes[rank] == nodes[rank ^ 1], f"tp pair {rank}, {rank ^ 1} spans nodes {nodes}"
    x, y = models.tokens(BATCH, SEQ, seed=2), models.tokens(BATCH, SEQ, seed=3)
    rows = slice(pm.dp_rank * BATCH // 2, (pm.dp_rank + 1) * BATCH // 2)
    opt, ref_opt = torch.optim.AdamW(pm.parameters(), **ADAM), torch.optim.AdamW(ref.parameters(), **ADAM)
    for _ in range(STEPS):
        pm.step(x[rows], target=y[rows], loss_fn=models.loss_fn)
        models.loss_fn(ref(x), y).backward()
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
    full = pm.full_state_dict()
    for key, want in ref.state_dict().items():
        assert_close(full[key], want, rtol=1e-5, atol=1e-5, msg=lambda m: f"rank {rank} {key}: {m}")
    print(f"rank {rank} on node {nodes[rank]}: dp_rank {pm.dp_rank}, exact after {STEPS} steps", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
