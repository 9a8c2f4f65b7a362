"""autotp's tests. Multi-process checks spawn real gloo process groups (see distributed.py)."""
