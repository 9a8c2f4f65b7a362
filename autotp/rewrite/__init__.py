"""The rewrite: the only code that changes graphs after capture. Per-rank GraphModules from a captured model
and a plan.

``rank_graph`` shards parameters, fixes shape constants and inserts collectives (``collectives``);
``stage_graphs`` cuts a rank's graph into pipeline stages; ``random_draws`` makes random ops draw the unsharded
model's values from a rank's ``streams.RankStream``; ``shards`` slices values whose split is sized at run time.
"""

from autotp.rewrite.rank_graph import build_graph, materialise, materialise_all, rewrite
from autotp.rewrite.stage_graphs import split_stages

__all__ = ["build_graph", "materialise", "materialise_all", "rewrite", "split_stages"]
