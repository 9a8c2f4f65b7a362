"""Run by torchrun in tests/test_examples.py: the process group is made by the user, before autotp's runtime is
imported (as ``examples/tp_demo.py`` does); after ``destroy_process_group`` no gloo thread may be left.

A group kept alive past it (torch's modules imported late hold it as a default argument) keeps gloo's threads
running into interpreter shutdown, where freeing the last collective's work needs Python and aborts the process
(``terminate called without an active exception``), in about one run in four under load.
"""

from __future__ import annotations

import gc
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import autotp  # noqa: E402


def gloo_threads(kinds: tuple[str, ...] = ("pt_gloo_runloop", "gloo")) -> int:
    """The threads of this process that gloo started: its groups' run loops (which free a finished collective's
    work, and need Python for it) and its transport's loop."""
    tasks = os.listdir("/proc/self/task")
    return sum(Path(f"/proc/self/task/{t}/comm").read_text().startswith(kinds) for t in tasks)


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    late = "autotp.runtime.process" not in sys.modules  # the order this script is for
    from tests import models  # imports autotp's runtime

    rank = dist.get_rank()
    pm = autotp.parallelize(models.build("gpt", layers=1), tp=2, example_inputs=(models.tokens(2, 8, seed=1),))
    pm.step(models.tokens(2, 8, seed=2), target=models.tokens(2, 8, seed=3), loss_fn=models.loss_fn)
    pm.full_state_dict()
    dist.destroy_process_group()
    left = gloo_threads(("pt_gloo_runloop",))
    del pm
    gc.collect()
    print(f"rank {rank}: runtime imported after the group: {late}; run loops after destroy_process_group: {left}, "
          f"gloo threads once the module is freed: {gloo_threads()}", flush=True)


if __name__ == "__main__":
    main()
