"""autotp's tests. Multi-process checks spawn real gloo process groups (see distributed.py)."""

import os
import sys

# The ranks are forked from pytest's process (distributed.py), which has run matrix products on several threads
# (the one-process checker's simulated ranks). With MKL's own memory manager on, some forks of such a process left
# a rank spinning forever in its first sgemm (in mkl_serv_allocate, seen with gdb) and its peer waiting in a
# collective: CI's intermittent hangs. With the manager off, none (``python -m bench.fork_hangs``). MKL reads this
# when torch loads it, so it is set before torch is imported; ``FORK_SAFE`` says whether that was in time.
if "torch" not in sys.modules:
    os.environ.setdefault("MKL_DISABLE_FAST_MM", "1")
FORK_SAFE = os.environ.get("MKL_DISABLE_FAST_MM") == "1"

# Each test model is captured once per process (pytest's and every spawned rank's, which imports this package
# to load its worker): an exact memo, see capture_cache.
from tests import capture_cache  # noqa: E402

capture_cache.install()
