"""autotp's tests. Multi-process checks spawn real gloo process groups (see distributed.py)."""

# Each test model is captured once per process (pytest's and every spawned rank's, which imports this package
# to load its worker): an exact memo, see capture_cache.
from tests import capture_cache  # noqa: E402

capture_cache.install()
