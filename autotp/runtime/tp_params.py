"""Parameters that state their tensor-parallel layout as torch's own tensor parallelism does: DTensors.

A rank graph computes on its local shards. Its parameters are nonetheless DTensors over the tensor-parallel
mesh (``Shard(dim)`` for a split parameter, ``Replicate()`` for one every rank holds whole), each read in the
graph by a ``get_attr`` followed by a differentiable ``to_local()``: the graph's arithmetic is unchanged, and
the gradients land as DTensors of the same placement. Tools that know nothing of autotp then see the layout:
``torch.nn.utils.clip_grad_norm_(pm.parameters(), c)`` sums the shards' norms over the mesh (the unsharded
model's norm), torch's optimizers step the local shards, FSDP2 composes its dp sharding with the tp placement.

The runtime decides the placements (``layout_of``) and the mesh (``tp_mesh``); ``rewrite.local_reads.distribute``
makes the parameters and the graphs' local reads. A DTensor built with ``DTensor.from_local(local, mesh, placements, shape=full, stride=...)`` keeps its true
global shape even when the chunks are uneven (a vocabulary tp does not divide); autotp itself never asks DTensor
to move data between the ranks of a split parameter (it keeps its own chunk layouts: fused segments, uneven
vocabularies), only to reduce norms, so only the placement's *kind* matters to it.

Chunks several ranks hold (``placement.replicas > 1``: KV heads when tp exceeds them) are no 1-D placement: a
``Shard`` would count each chunk once per holder. A module holding one keeps plain tensors (``expressible``),
and ``pm.clip_grad_norm_`` is then the exact way to clip.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard

from autotp.torch_private import release_groups
from autotp.planning.plan import Plan
from autotp.runtime.state import StateNames


def tp_mesh(group, device: torch.device) -> DeviceMesh:
    """The 1-D DeviceMesh over the tensor-parallel process ``group`` (made from the group: no new communicator).

    It names the group without holding it (as autotp's communicator holds the default group by name only): a mesh
    holding it would keep it, and its gloo threads, alive past ``destroy_process_group`` into interpreter shutdown.
    """
    mesh = DeviceMesh.from_group(group or dist.group.WORLD, device.type, mesh_dim_names=("tp",))
    release_groups(mesh)  # DTensor's collectives find the group by its name
    return mesh


def expressible(plan: Plan) -> bool:
    """Whether every parameter's tensor-parallel layout is a 1-D DTensor placement (no chunk held by several
    ranks)."""
    return all(not p.is_split or p.replicas == 1 for p in plan.placements.values())


def warn_plain(plan: Plan) -> None:
    """Say once that this module's parameters stay plain tensors, and how to clip exactly then."""
    shared = sorted(n for n, p in plan.placements.items() if p.is_split and p.replicas > 1)
    warnings.warn(f"autotp: {shared[0]} (and {len(shared) - 1} more) is split in chunks several tensor-parallel ranks "
                  "hold, which a DTensor placement over the tp mesh cannot state, so pm.parameters() stay plain "
                  "local tensors: torch.nn.utils.clip_grad_norm_ would clip each rank by its own norm (and the "
                  "next forward would raise DriftError); clip with pm.clip_grad_norm_(max_norm)", stacklevel=3)


def placement_of(plan: Plan, name: str):
    """The DTensor placement of kept parameter ``name`` over the tp mesh: ``Shard(dim)`` or ``Replicate()``."""
    placement = plan.placements.get(name)
    if placement is None or not placement.is_split or plan.tp == 1:
        return Replicate()
    return Shard(placement.dim)


def layout_of(plan: Plan, names: StateNames):
    """A function from a rank module's parameter target to its DTensor placement and full shape (for
    ``rewrite.local_reads.distribute``)."""
    def layout(target: str, local_shape: tuple[int, ...]):
        name = names.param_name(target)
        kept = names.aliases.get(name, name)
        return placement_of(plan, kept), tuple(names.shapes.get(kept, local_shape))
    return layout
