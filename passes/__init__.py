"""Read-only graph passes: find projections, embeddings, regions and cuts, propagate sharding, cost nodes.

Installed as ``autotp.passes``. Nothing here mutates a graph (the rewriter does that), and nothing
here imports the rest of autotp: passes import only passes and third-party libraries.
"""

from autotp.passes.analysis import Analysis
from autotp.passes.placement import PlacementKind, Shard
from autotp.passes.projections import (
           Embedding,
           Projection,
           find_embeddings,
           find_projections,
)
from autotp.passes.propagate import propagate
from autotp.passes.propagation import Propagation
from autotp.passes.region_match import RegionKind
from autotp.passes.steps import COMMUNICATION, CollectiveOp, Direction, Operator, Step

__all__ = ["COMMUNICATION", "Analysis", "CollectiveOp", "Direction", "Embedding", "Operator", "PlacementKind",
           "Projection", "Propagation", "RegionKind", "Shard", "Step", "find_embeddings", "find_projections",
           "propagate"]
