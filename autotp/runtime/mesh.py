"""Where each rank sits: a (pp × dp × tp) DeviceMesh and the process groups along its axes.

Tensor-parallel ranks are innermost (consecutive global ranks share a tp group, as in Megatron and
torchtitan: on GPUs they share a node's fast links), data-parallel replicas next, pipeline stages
outermost. Global rank = (pp_rank · dp + dp_rank) · tp + tp_rank.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

AXES = ("pp", "dp", "tp")
"""The mesh's dimension names, outermost first."""


def global_rank(pp_rank: int, dp_rank: int, tp_rank: int, dp: int, tp: int) -> int:
    """The global rank at mesh position (pp_rank, dp_rank, tp_rank)."""
    return (pp_rank * dp + dp_rank) * tp + tp_rank


class Mesh:
    """This rank's place in the (pp × dp × tp) grid and the groups along each axis."""

    def __init__(self, pp: int, tp: int, device: torch.device, dp: int = 1, timeout: timedelta | None = None,
                 placement: Callable[[int, int], int] | None = None):
        self.pp, self.dp, self.tp = pp, dp, tp
        self.placement = placement or (lambda stage, pp: stage % pp)
        """(stage, pp) -> the pipeline rank holding that stage (the schedule's: looped or V)."""
        self.device = device
        self.mesh = init_device_mesh(device.type, (pp, dp, tp), mesh_dim_names=AXES,
                                     backend_override=_with_timeout(device, timeout))
        self.tp_group, self.pp_group = self.mesh.get_group("tp"), self.mesh.get_group("pp")
        self.dp_group = self.mesh.get_group("dp")
        self.pp_rank, self.tp_rank = self.mesh.get_local_rank("pp"), self.mesh.get_local_rank("tp")
        self.dp_rank = self.mesh.get_local_rank("dp")

    @property
    def dp_mesh(self):
        """The 1-D sub-mesh of this rank's data-parallel replicas (what FSDP shards over)."""
        return self.mesh["dp"]

    def close(self) -> None:
        """Drop the references to the mesh's process groups."""
        self.mesh = self.tp_group = self.pp_group = self.dp_group = None

    def rank_of(self, stage: int) -> int:
        """Global rank holding pipeline ``stage`` in this rank's (dp, tp) column."""
        return global_rank(self.placement(stage, self.pp), self.dp_rank, self.tp_rank, self.dp, self.tp)


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
