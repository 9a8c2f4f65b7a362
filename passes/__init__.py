"""Read-only graph passes: find projections, embeddings and regions, and propagate sharding.

Installed as ``autotp.passes``. Nothing here mutates a graph; the rewriter does that.
"""

from autotp.passes.layout import Shard
from autotp.passes.projections import Embedding, Projection, find_embeddings, find_projections
from autotp.passes.propagate import Propagation, propagate

__all__ = ["Embedding", "Projection", "Propagation", "Shard", "find_embeddings", "find_projections", "propagate"]
