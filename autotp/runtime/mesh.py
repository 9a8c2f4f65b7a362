"""Where each rank sits: a (pp × dp × tp) DeviceMesh and the process groups along its axes; with context
parallelism, (pp × dp × cp × tp).

Tensor-parallel ranks are innermost (consecutive global ranks share a tp group, as in Megatron and
torchtitan: on GPUs they share a node's fast links), context-parallel ranks next (their K/V exchange is the next
busiest traffic), then data-parallel replicas, pipeline stages outermost.
Global rank = ((pp_rank · dp + dp_rank) · cp + cp_rank) · tp + tp_rank.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

AXES = ("pp", "dp", "tp")
"""The mesh's dimension names, outermost first."""
CONTEXT_AXES = ("pp", "dp", "cp", "tp")
"""The mesh's dimension names with context parallelism, outermost first."""


def global_rank(pp_rank: int, dp_rank: int, tp_rank: int, dp: int, tp: int, cp_rank: int = 0, cp: int = 1) -> int:
    """The global rank at mesh position (pp_rank, dp_rank, cp_rank, tp_rank)."""
    return ((pp_rank * dp + dp_rank) * cp + cp_rank) * tp + tp_rank


class Mesh:
    """This rank's place in the (pp × dp × tp) grid, or (pp × dp × cp × tp) with ``cp > 1``, and the groups along
    each axis."""

    def __init__(self, pp: int, tp: int, device: torch.device, dp: int = 1, timeout: timedelta | None = None,
                 placement: Callable[[int, int], int] | None = None, cp: int = 1):
        self.pp, self.dp, self.tp, self.cp = pp, dp, tp, cp
        self.placement = placement or (lambda stage, pp: stage % pp)
        """(stage, pp) -> the pipeline rank holding that stage (the schedule's: looped or V)."""
        self.device = device
        axes = AXES if cp == 1 else CONTEXT_AXES
        shape = (pp, dp, tp) if cp == 1 else (pp, dp, cp, tp)
        self.mesh = init_device_mesh(device.type, shape, mesh_dim_names=axes,
                                     backend_override=_with_timeout(device, timeout, axes))
        self.tp_group, self.pp_group = self.mesh.get_group("tp"), self.mesh.get_group("pp")
        self.dp_group = self.mesh.get_group("dp")
        self.pp_rank, self.tp_rank = self.mesh.get_local_rank("pp"), self.mesh.get_local_rank("tp")
        self.dp_rank = self.mesh.get_local_rank("dp")
        self.cp_group = self.mesh.get_group("cp") if cp > 1 else None
        self.cp_rank = self.mesh.get_local_rank("cp") if cp > 1 else 0
        self.norm_group = _cp_index_group(self, timeout) if cp > 1 else None
        """The ranks of this rank's cp index (cp > 1): together they hold every gradient once (cp ranks hold
        copies), so a gradient norm sums over them."""

    @property
    def dp_mesh(self):
        """The 1-D sub-mesh of this rank's data-parallel replicas (what FSDP shards over)."""
        return self.mesh["dp"]

    def close(self) -> None:
        """Drop the references to the mesh's process groups."""
        self.mesh = self.tp_group = self.pp_group = self.dp_group = self.cp_group = self.norm_group = None

    def rank_of(self, stage: int) -> int:
        """Global rank holding pipeline ``stage`` in this rank's (dp, cp, tp) column."""
        return global_rank(self.placement(stage, self.pp), self.dp_rank, self.tp_rank, self.dp, self.tp,
                           self.cp_rank, self.cp)


def _cp_index_group(mesh: Mesh, timeout: timedelta | None):
    """The (pp × dp × tp) ranks of ``mesh``'s cp index (every rank makes every such group, in one order)."""
    mine = None
    for cp_rank in range(mesh.cp):
        ranks = [global_rank(p, d, t, mesh.dp, mesh.tp, cp_rank, mesh.cp)
                 for p in range(mesh.pp) for d in range(mesh.dp) for t in range(mesh.tp)]
        group = dist.new_group(ranks, timeout=timeout) if timeout is not None else dist.new_group(ranks)
        if cp_rank == mesh.cp_rank:
            mine = group
    return mine


def _with_timeout(device: torch.device, timeout: timedelta | None, axes: tuple[str, ...] = AXES):
    """Each axis's group made with ``timeout``: a group's point-to-point waits (a pipeline's sends and receives)
    keep the timeout it was made with, and torch would make the mesh's with its own default (30 minutes)."""
    if timeout is None:
        return None
    if device.type == "cuda":
        options, backend = dist.ProcessGroupNCCL.Options(), "nccl"
    else:
        options, backend = dist.ProcessGroupGloo._Options(), "gloo"
    options._timeout = timeout
    return {axis: (backend, options) for axis in axes}
