"""A rank's generation graph: the KV cache tensors it is given already split, as the K/V heads written into them.

The plan says how the weights are split; a cache is state placed like a weight (each rank holds the K/V heads its
attention uses, and with tp above the KV heads the head it shares with others: ``Shard.replicas``). Which split
that is follows from the graph: propagate once with the cache whole, read the layout of the values each cache
input's in-place write produces, then build the rank graph with the cache inputs given in those layouts. A cache
that no split reaches stays whole on every rank (still exact).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import fx, nn

from autotp.capture import Captured
from autotp.capture.core.kv_cache import (
    FIRST_CACHE_INPUT,
    CacheShape,
    cache_shape,
    capture_step,
)
from autotp.errors import InternalError
from autotp.passes.placement import Shard
from autotp.planning.plan import Plan
from autotp.rewrite.comm import Communicator
from autotp.rewrite.graph_edit import set_tensor
from autotp.rewrite.inference_steps import inference_step
from autotp.rewrite.lean_steps import lean_step
from autotp.rewrite.local_reads import read_locally
from autotp.rewrite.rank_graph import build_graph

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
    prop = captured.analysis.propagate_placements(plan.placements, plan.tp)
    found = {}
    for p in placeholders:
        lay = prop.layouts.get(_writer(p).name)
        found[p.name] = lay if isinstance(lay, Shard) and lay.blocks == 1 and not lay.spread else None
    return found


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


@dataclass
class CacheSteps:
    """A rank's generation step (prompt and new tokens alike), its cache inputs split as ``layouts`` (one per cache
    tensor)."""

    shape: CacheShape
    layouts: list[Shard | None]
    step: fx.GraphModule


def build_cache_steps(model: nn.Module, plan: Plan, rank: int, comm: Communicator | None,
                      tensors: dict[str, torch.Tensor]) -> CacheSteps:
    """Capture ``model``'s generation step with its cache as inputs and build this rank's graph of it, reading
    ``tensors`` (a parallel module's own, by original name: no copy, so training updates them)."""
    shape = cache_shape(model)
    captured = capture_step(model, shape)
    layouts = cache_layouts(captured, plan, FIRST_CACHE_INPUT)
    gm = build_step_graph(captured, plan, rank, comm, layouts)
    share_tensors(gm, captured, tensors)
    return CacheSteps(shape, list(layouts.values()), inference_step(lean_step(gm, _dtypes_kept(model, tensors))))


def _dtypes_kept(model: nn.Module, tensors: dict[str, torch.Tensor]) -> bool:
    """Whether the parallel module's tensors have the dtypes of the model the steps were captured from (a module
    cast after parallelize would make the captured no-op casts real ones)."""
    captured = dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers(remove_duplicate=False))
    return all(t.dtype == tensors[name].dtype for name, t in captured.items() if name in tensors)


def _held_names(gm: fx.GraphModule, captured: Captured) -> list[tuple[str, str]]:
    """(attribute target, original name) of every tensor ``gm`` reads."""
    targets = [t for t, _ in [*gm.named_parameters(remove_duplicate=False), *gm.named_buffers(remove_duplicate=False)]]
    return [(t, captured.aliases.get(captured.param_name(t), captured.param_name(t))) for t in targets]


def unheld_tensors(gm: fx.GraphModule, captured: Captured, tensors: dict) -> list[str]:
    """The original names of the tensors ``gm`` reads that ``tensors`` (a parallel module's) lacks."""
    return [name for _, name in _held_names(gm, captured) if name not in tensors]


def share_tensors(gm: fx.GraphModule, captured: Captured, tensors: dict, what: str = "the generation step") -> None:
    """Point ``gm``'s attributes at the parallel module's tensors of the same original names (no copy: training
    updates them in place); ``what`` names the graph in the error when one is missing."""
    for target, name in _held_names(gm, captured):
        if name not in tensors:
            raise InternalError(f"{what} reads {name}, which the parallel module's graphs do not hold")
        set_tensor(gm, target, tensors[name])
    read_locally(gm)  # the module's DTensor parameters, read as the local tensors the graph computes on
