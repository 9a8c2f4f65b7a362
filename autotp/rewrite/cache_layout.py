"""A rank's generation graph: the KV cache tensors it is given already split, as the K/V heads written into them.

The plan says how the weights are split; a cache is state placed like a weight (each rank holds the K/V heads its
attention uses, and with tp above the KV heads the head it shares with others: ``Shard.replicas``). Which split
that is follows from the graph: propagate once with the cache whole, read the layout of the values each cache
input's in-place write produces, then build the rank graph with the cache inputs given in those layouts. A cache
that no split reaches stays whole on every rank (still exact).
"""

from __future__ import annotations

import torch
from torch import fx

from autotp.capture import Captured
from autotp.errors import InternalError
from autotp.passes.analysis import Analysis
from autotp.passes.layout import Shard
from autotp.planning.plan import Plan
from autotp.planning.planner import param_layouts, target_placements
from autotp.rewrite.comm import Communicator
from autotp.rewrite.tensor_parallel import build_graph

aten = torch.ops.aten


def _writer(placeholder: fx.Node) -> fx.Node:
    """The in-place write into a cache input (its one ``index_copy_``)."""
    writes = [u for u in placeholder.users if u.target is aten.index_copy_.default and u.args[0] is placeholder]
    if len(writes) != 1:
        raise InternalError(f"cache input {placeholder.name} is written {len(writes)} times in the captured step "
                            "(expected one index_copy_)")
    return writes[0]


def cache_layouts(captured: Captured, plan: Plan, first_cache_input: int) -> dict[str, Shard | None]:
    """Each cache input's layout (placeholder name -> Shard, or None: whole): that of the K/V values written into it."""
    placeholders = list(captured.graph.find_nodes(op="placeholder"))[first_cache_input:]
    if plan.tp == 1:
        return {p.name: None for p in placeholders}
    analysis = Analysis(captured)
    prop = analysis.propagate(param_layouts(analysis, target_placements(captured, plan)), plan.tp)
    found = {}
    for p in placeholders:
        lay = prop.layouts.get(_writer(p).name)
        found[p.name] = lay if isinstance(lay, Shard) and lay.blocks == 1 and not lay.spread else None
    return found


def local_shape(shape: tuple[int, ...], lay: Shard | None, tp: int) -> tuple[int, ...]:
    """A rank's shape of a whole ``shape`` split as ``lay``."""
    if lay is None:
        return shape
    out = list(shape)
    out[lay.dim] = sum(s // lay.chunks(tp) for s in lay.segments)
    return tuple(out)


def build_step_graph(captured: Captured, plan: Plan, rank: int, comm: Communicator | None,
                     layouts: dict[str, Shard | None]) -> fx.GraphModule:
    """This rank's graph of a captured generation step, its cache inputs given in ``layouts``; its attributes still
    point at the model's tensors. A cache input that would need converting (it is written in place) is a bug."""
    split = {name: lay for name, lay in layouts.items() if lay is not None}
    gm = build_graph(captured, plan, rank, comm, stream=None, inputs=split)
    for node in gm.graph.find_nodes(op="placeholder"):
        if node.name in layouts and any(u.op == "call_module" for u in node.users):
            raise InternalError(f"cache input {node.name} is converted before it is written; its layout "
                                f"{layouts[node.name]} is not the one its writes and reads agree on")
    return gm
