"""Run by torchrun in tests/test_examples.py: the process group is made by the user, before autotp's runtime is
imported (as ``examples/tp_demo.py`` does), and destroyed at the end; once autotp's exit handlers have run, no
gloo thread may be left.

A group kept alive into interpreter shutdown keeps gloo's threads running there, where freeing the last
collective's work needs Python and aborts the process (``terminate called without an active exception``; one
tp_demo run in four under load). Two holders were found: torch's modules imported after the group was made hold
it as a default argument, and torch's DTensor caches hold the meshes FSDP sharded over.
"""

from __future__ import annotations

import atexit
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import autotp  # noqa: E402


def gloo_threads() -> int:
    """The threads of this process that gloo started: its groups' run loops and its transport's loops."""
    tasks = os.listdir("/proc/self/task")
    return sum(Path(f"/proc/self/task/{t}/comm").read_text().startswith(("pt_gloo", "gloo")) for t in tasks)


def report(rank: int, late: bool) -> None:
    """Registered before autotp's runtime is imported, so it runs after autotp's exit handlers (atexit is LIFO)."""
    print(f"rank {rank}: runtime imported after the group: {late}; gloo threads at exit: {gloo_threads()}",
          flush=True)


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    atexit.register(report, rank, "autotp.runtime.process" not in sys.modules)
    from tests import models  # imports autotp's runtime

    pm = autotp.parallelize(models.build("gpt", layers=1), tp=2, dp=2, example_inputs=(models.tokens(2, 8, seed=1),))
    pm.step(models.tokens(2, 8, seed=2), target=models.tokens(2, 8, seed=3), loss_fn=models.loss_fn)
    pm.full_state_dict()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
