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
``Shard`` would count each chunk once per holder. They are on a 2-D view of the same ranks (``tp_mesh_2d``):
(tp / holders, holders), rank ``chunk * holders + j`` (as autotp lays such chunks out), where a shared chunk is
``(Shard(dim), Replicate())`` (each chunk counted once), a chunk of one rank ``(Shard(dim), Shard(dim))`` and a
whole parameter ``(Replicate(), Replicate())``: every parameter on one mesh, so torch's clipping stacks their
norms. That view needs one holder count for the module. Where every rank knows every tp group (tp alone over
the world, or dp > 1 replicas) it is cut from one (groups, tp / holders, holders) mesh made over the world; a
``group=`` that is not the world makes its view's subgroups among its own ranks. Under FSDP's sharding (which
composes with a 1-D tp mesh only) the module keeps plain tensors and warns (``warn_plain``), and
``pm.clip_grad_norm_`` is then the exact way to clip.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from autotp.torch_private import release_groups
from autotp.planning.plan import Plan
from autotp.runtime.state import StateNames


def plain(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's local tensor of ``tensor`` (a DTensor's local shard, sharing its storage), else itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


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
                  "hold, which a DTensor placement over the tp mesh cannot state (a 2-D view of it can, with pp=1 "
                  "and dp_mode='replicate'), so pm.parameters() stay plain "
                  "local tensors: torch.nn.utils.clip_grad_norm_ would clip each rank by its own norm (and the "
                  "next forward would raise DriftError); clip with pm.clip_grad_norm_(max_norm)", stacklevel=3)


def shared_holders(plan: Plan) -> int | None:
    """How many ranks hold each shared chunk of ``plan``'s parameters (one count for all: a 2-D view can state
    them); None where the counts differ or nothing is shared."""
    counts = {p.replicas for p in plan.placements.values() if p.is_split and p.replicas > 1}
    return counts.pop() if len(counts) == 1 else None


def tp_layout(group, dp_mesh: DeviceMesh | None = None) -> torch.Tensor | None:
    """Every tensor-parallel group's ranks, one row each (an (n, tp) tensor over the whole world), or None where
    this rank cannot know them: a ``group`` that is not the whole world. Under data parallelism ``dp_mesh`` (the
    (pp, dp, tp) mesh) has them: each replica's tp group is a row."""
    if dp_mesh is not None:
        return dp_mesh.mesh.reshape(-1, dp_mesh.mesh.shape[-1])
    ranks = dist.get_process_group_ranks(group or dist.group.WORLD)
    return torch.tensor(ranks).reshape(1, -1) if len(ranks) == dist.get_world_size() else None


def tp_mesh_2d(layout: torch.Tensor | None, device: torch.device, holders: int, group=None) -> DeviceMesh | None:
    """This rank's (tp / holders, holders) view of its tensor-parallel ranks, or None where it cannot be made.

    With every tp group known (``layout``: see ``tp_layout``) the view's subgroups are made collectively over the
    world, so the mesh is made over all of them at once, (groups, tp / holders, holders), and this rank's group
    taken from it: under dp > 1 every replica has its own view of the same shape. A ``group`` that is not the
    world (no ``layout``) makes the two subgroups of its own view among its own ranks alone (``_view_of_group``)."""
    if layout is None:
        return _view_of_group(group, device, holders)
    if layout.shape[1] % holders:
        return None
    cube = layout.reshape(layout.shape[0], layout.shape[1] // holders, holders)
    view = DeviceMesh(device.type, cube, mesh_dim_names=("tp_groups", "tp_chunks", "tp_holders"))["tp_chunks",
                                                                                                    "tp_holders"]
    release_groups(view)  # as tp_mesh (and the view's root): DTensor's collectives find the subgroups by name
    return view


def _view_of_group(group, device: torch.device, holders: int) -> DeviceMesh | None:
    """The (tp / holders, holders) view of the ranks of ``group`` alone: this rank's column and row of it made
    as process groups with local synchronization (only their members take part, every member in the same order:
    the column first), then put together as a 2-D mesh."""
    ranks = dist.get_process_group_ranks(group)
    if len(ranks) % holders:
        return None
    square = torch.tensor(ranks).reshape(len(ranks) // holders, holders)
    row, column = (int(i) for i in (square == dist.get_rank()).nonzero()[0])
    axes = [dist.new_group(square[:, column].tolist(), use_local_synchronization=True),
            dist.new_group(square[row].tolist(), use_local_synchronization=True)]
    view = DeviceMesh.from_group(axes, device.type, mesh=square, mesh_dim_names=("tp_chunks", "tp_holders"))
    release_groups(view)
    return view


def placement_of(plan: Plan, name: str, holders: int | None = None) -> tuple:
    """The DTensor placements of kept parameter ``name``: over the tp mesh ``(Shard(dim),)`` or ``(Replicate(),)``;
    over the 2-D view with ``holders`` (``tp_mesh_2d``) a pair, a chunk shared by ``holders`` ranks replicated on
    the view's second dimension."""
    placement = plan.placements.get(name)
    split = placement is not None and placement.is_split and plan.tp > 1
    if holders is None:
        return (Shard(placement.dim),) if split else (Replicate(),)
    if not split:
        return Replicate(), Replicate()
    return (Shard(placement.dim), Replicate() if placement.replicas == holders else Shard(placement.dim))


def layout_of(plan: Plan, names: StateNames, holders: int | None = None):
    """A function from a rank module's parameter target to its DTensor placements and full shape (for
    ``rewrite.local_reads.distribute``), over the tp mesh or (``holders``) its 2-D view."""
    def layout(target: str, local_shape: tuple[int, ...]):
        name = names.param_name(target)
        kept = names.aliases.get(name, name)
        return placement_of(plan, kept, holders), tuple(names.shapes.get(kept, local_shape))
    return layout
