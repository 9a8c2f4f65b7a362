"""Run by torchrun in tests/test_peers.py: rank 1 hangs after one step; rank 0's next step fails.

torchrun must report rank 1, the hung one, as the root cause (``@record`` writes each rank's error file).
"""

import sys
import time
from pathlib import Path

import torch
from torch.distributed.elastic.multiprocessing.errors import record

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import autotp  # noqa: E402
from tests import models  # noqa: E402


@record
def main() -> None:
    torch.set_num_threads(1)
    model = models.build("gpt")
    x, y = models.tokens(4, 16, 1), models.tokens(4, 16, 2)
    pm = autotp.parallelize(model, tp=2, example_inputs=(x,), timeout=5, quiet=True)
    pm.step(x, target=y)
    if pm.rank == 1:
        time.sleep(3600)
    pm.step(x, target=y)


if __name__ == "__main__":
    main()
