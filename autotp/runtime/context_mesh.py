"""Where a context-parallel rank sits: a (dp × cp × tp) DeviceMesh, tp innermost, then cp, then dp (Megatron's
order: a cp group's K/V exchange is the next-busiest traffic after tensor parallelism's, so its ranks sit next).
Global rank = (dp_rank · cp + cp_rank) · tp + tp_rank.

It offers what ``DataParallel`` reads of a ``Mesh`` (``dp``, ``dp_rank``, ``dp_mesh``, ``dp_group``, ``close``),
plus the cp group and the group a gradient norm spans: the ranks of one cp index, which together hold each
gradient once (the cp ranks hold copies of it).
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from autotp.runtime.mesh import _with_timeout

AXES = ("dp", "cp", "tp")
"""The mesh's dimension names, outermost first."""


def context_rank(dp_rank: int, cp_rank: int, tp_rank: int, cp: int, tp: int) -> int:
    """The global rank at mesh position (dp_rank, cp_rank, tp_rank)."""
    return (dp_rank * cp + cp_rank) * tp + tp_rank


class ContextMesh:
    """This rank's place in the (dp × cp × tp) grid and the groups along each axis."""

    def __init__(self, dp: int, cp: int, tp: int, device: torch.device, timeout: timedelta | None = None):
        self.pp, self.dp, self.cp, self.tp = 1, dp, cp, tp
        self.device = device
        self.mesh = init_device_mesh(device.type, (dp, cp, tp), mesh_dim_names=AXES,
                                     backend_override=_with_timeout(device, timeout, AXES))
        self.dp_group, self.cp_group, self.tp_group = (self.mesh.get_group(a) for a in AXES)
        self.dp_rank, self.cp_rank, self.tp_rank = (self.mesh.get_local_rank(a) for a in AXES)
        self.norm_group = self._norm_group(timeout) if dp > 1 else self.tp_group

    def _norm_group(self, timeout: timedelta | None):
        """The (dp × tp) ranks of this rank's cp index (every rank makes every such group, in one order)."""
        mine = None
        for cp_rank in range(self.cp):
            ranks = [context_rank(d, cp_rank, t, self.cp, self.tp) for d in range(self.dp) for t in range(self.tp)]
            group = dist.new_group(ranks, timeout=timeout) if timeout is not None else dist.new_group(ranks)
            if cp_rank == self.cp_rank:
                mine = group
        return mine

    @property
    def dp_mesh(self):
        """The 1-D sub-mesh of this rank's data-parallel replicas (what FSDP shards over)."""
        return self.mesh["dp"]

    def close(self) -> None:
        """Drop the references to the mesh's process groups."""
        self.mesh = self.tp_group = self.cp_group = self.dp_group = self.norm_group = None
