"""The rewrite: the only code that changes graphs. Per-rank GraphModules from a captured model and a plan.

``tensor_parallel`` shards parameters, fixes shape constants and inserts collectives (``collectives``);
``stages`` cuts a rank's graph into pipeline stages; ``shards`` slices and reassembles tensors.
"""

from autotp.rewrite.stages import split_stages
from autotp.rewrite.tensor_parallel import Source, Want, build_graph, materialise, materialise_all, own_tensors, rewrite

__all__ = ["Source", "Want", "build_graph", "materialise", "materialise_all", "own_tensors", "rewrite",
           "split_stages"]
