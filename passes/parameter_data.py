"""A rank graph's reads of a parameter's ``.data`` and the in-place writes made through them (read-only).

The rewriter makes a forward's writes into its own weights (``p.data.clamp_(...)``) write through ``data_of``
(``autotp.rewrite.data_writes``); the runtime finds them again (``data_writes``) to make the same writes on the
stored shards under FSDP. Both read the graph through this module, so the runtime needs nothing of the rewriter's.
"""

from __future__ import annotations

import torch
from torch import fx


def data_of(parameter: torch.Tensor) -> torch.Tensor:
    """``parameter.data``: its storage, outside autograd's view (a graph's op, so the write reads it when it runs)."""
    return parameter.data


def data_writes(gm: fx.GraphModule) -> list[tuple[fx.Node, fx.Node]]:
    """(the write, the parameter's ``get_attr``) for every in-place write ``gm`` makes through ``data_of``."""
    return [(user, node.args[0]) for node in gm.graph.nodes if node.target is data_of for user in node.users]
