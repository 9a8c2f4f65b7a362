"""The body of the spawned teardown test (tests/test_generation.py).

Its exit check fails a rank whose gloo threads outlive the harness's ``destroy_process_group``. It guards the
harness's teardown, not ``free_default_group_on_destroy``: ``tests/__init__`` (capture_cache) already imports
``torch.distributed.nn`` before any group exists, so main's code passes it too (measured); a worker outside the
``tests`` package would also guard that."""

from __future__ import annotations

import atexit
import os
import sys

import torch

import autotp

GLOO_OUTLIVED_ITS_GROUP = 86
"""The exit status of a rank whose gloo threads were still running at interpreter exit (``generation_then_exit``)."""


def _gloo_threads() -> list[str]:
    """The names of this process's gloo threads (a group's workers and its transport's event loop)."""
    names = []
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                names.append(f.read().strip())
        except FileNotFoundError:  # a thread that ended since the listing
            pass
    return [n for n in names if "gloo" in n]


def _exit_if_gloo_outlived_its_group() -> None:
    left = _gloo_threads()
    if left:  # left to interpreter shutdown, where one that needs Python aborts the process (issue 23)
        print(f"rank {os.environ.get('LOCAL_RANK')}: gloo threads {left} outlived destroy_process_group",
              file=sys.stderr, flush=True)
        os._exit(GLOO_OUTLIVED_ITS_GROUP)


def generation_then_exit(rank: int, world: int) -> dict:
    """A short greedy generation at tp=``world``, bench.generation's path: the model (its config) built after the
    group exists, tokens over shared memory; then the harness's teardown. At interpreter exit, which follows that
    teardown, the group's gloo threads must be gone: joined by ``destroy_process_group`` while Python still runs."""
    import transformers

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2)).eval()
    ids = torch.randint(0, 128, (2, 6), generator=torch.Generator().manual_seed(1))
    pm = autotp.parallelize(model, tp=world, example_inputs=(ids,), quiet=True)
    out = pm.generate(ids, max_new_tokens=3, do_sample=False)
    assert _gloo_threads(), "gloo's threads are not found by name: the exit check would pass vacuously"
    atexit.register(_exit_if_gloo_outlived_its_group)
    return {"transport": type(pm.generation.comm).__name__, "tokens": out.tolist()}
