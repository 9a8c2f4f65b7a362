"""The context-parallel module: this rank's model (every parameter whole, or its tensor-parallel shard with tp > 1),
its graphs rewritten to compute its own chunks of every sequence (``rewrite.context_graph``), exchanging over the cp
ranks. Ranks lie on a (dp × cp × tp) mesh (``runtime.context_mesh``): tensor parallelism splits heads and MLPs inside
each cp rank's chunk as usual, K/V move over the cp group alone, and data-parallel replicas each hold a cp group."""

from __future__ import annotations

import torch

from autotp.errors import InputError
from autotp.options import Recompute
from autotp.planning.context_plan import plan_context
from autotp.rewrite import build_graph, materialise_all
from autotp.rewrite.comm import TorchComm
from autotp.rewrite.context_graph import apply_context
from autotp.rewrite.dtypes import cast_for_policy
from autotp.rewrite.recompute import recompute_blocks
from autotp.rewrite.local_reads import distribute
from autotp.rewrite.streams import RankStream
from autotp.runtime.context_mesh import ContextMesh
from autotp.runtime.data_parallel import DataParallel
from autotp.runtime.parallel_base import RankParts
from autotp.runtime.input_spec import InputSpec
from autotp.runtime.integrations import facing, rank_config
from autotp.runtime.peers import group_timeout
from autotp.runtime.process import device_for, from_first_rank, shared_seed
from autotp.runtime.state import state_names
from autotp.runtime.tensor_module import ParallelModule
from autotp.runtime.tp_params import expressible, layout_of, warn_plain
from autotp.torch_private import release_groups


class NoGeneration:
    """``generate`` on a context-parallel module: refused, saying why (the plan's notes say so too)."""

    def _refuse(self, *_args, **_kwargs):
        raise InputError("pm.generate is not available on a context-parallel module (cp > 1): decoding from a "
                         "cache split along the sequence is not implemented. Generate with a module built at cp=1 "
                         "(pm.full_state_dict() carries the trained weights over)")

    generate = prepare = _refuse

    def close(self) -> None:
        """Nothing to release."""

    def manual_seed(self, seed: int) -> None:
        """No sampling stream to restart."""


class ContextParallelModule(ParallelModule):
    """A ``ParallelModule`` whose ``comm`` is its tensor-parallel group, one of ``cp`` ranks that hold the same
    parameters: a gradient norm and a checkpoint count each gradient once, not once per cp rank."""

    def __init__(self, parts: RankParts, graphs, mesh: ContextMesh | None):
        self.context_mesh = mesh
        super().__init__(parts, graphs, NoGeneration(), None)

    def _norm_group(self):
        # The ranks of this cp index: each (tp shard, dp shard) of every gradient once.
        return self.context_mesh.norm_group if self.context_mesh is not None else None

    def _checkpoint_group(self):
        # The whole world: the cp ranks (and replicas) hold the same chunks, and a save over it writes each once.
        return None

    def close(self) -> None:
        """Release the mesh's process groups too."""
        super().close()
        if self.context_mesh is not None and self.context_mesh.mesh is not None:
            release_groups(self.context_mesh.mesh)
            self.context_mesh.close()


def context_parallel(built, group, distributed: bool) -> ParallelModule:
    """This rank's context-parallel module of ``built`` (an ``api.Built`` whose options have cp > 1) on the
    (dp × cp × tp) mesh of the default group (or ``group``, whose ranks are then the cp ranks: tp = dp = 1)."""
    options = built.options
    if not distributed:
        raise InputError(f"cp={options.cp} needs a process group of cp ranks; use autotp.check to simulate "
                         "them in one process")
    alone = options.tp == 1 and options.dp == 1
    if group is not None and not alone:
        raise InputError("cp with tp > 1 or dp > 1 lays ranks out on a (dp x cp x tp) mesh over the default process "
                         "group; do not pass group")
    device = device_for(group, distributed)
    mesh = None if alone else ContextMesh(options.dp, options.cp, options.tp, device or torch.device("cpu"),
                                          group_timeout())
    cp_comm = TorchComm(group if mesh is None else mesh.cp_group)
    tp_comm = TorchComm(mesh.tp_group) if mesh is not None and options.tp > 1 else None
    stream = RankStream(shared_seed(group, distributed))
    source = built.source or from_first_rank(built.model, group, distributed)
    graphs, tp_rank = built.graphs, tp_comm.rank if tp_comm is not None else 0
    # No random stream: cp refuses random draws on split values, and the stream's rewrite renames dropout nodes
    # (p=0 ones too) that the sequence layout names.
    modules = {mode: build_graph(captured, built.plan, tp_rank, tp_comm) for mode, captured in graphs.items()}
    for gm in modules.values():
        cast_for_policy(gm, options)
    materialise_all([(modules[mode], graphs[mode]) for mode in modules], built.plan, tp_rank, source=source)
    for mode, gm in modules.items():
        layout = plan_context(graphs[mode], cp_comm.size, built.options.cp_exchange, built.options.memory_budget)
        apply_context(gm, layout, cp_comm, {n for n, p in gm.named_parameters() if p.requires_grad})
        if mode and options.recompute is Recompute.BLOCKS:  # blocks of the rewritten graph: their exchanges rerun
            recompute_blocks(gm, graphs[mode].analysis, None)
        if device is not None:
            gm.to(device)
    names = state_names(built.model, graphs[True], modules.values(), source)
    if tp_comm is not None:  # after the cp rewrite, so that a DTensor's local read feeds its gradient sum
        if expressible(built.plan):
            distribute(list(modules.values()), layout_of(built.plan, names), mesh.mesh["tp"])
        else:
            warn_plain(built.plan)
    dp = DataParallel(mesh, options.dp_mode, options.mixed_precision) if options.dp > 1 else None
    # With a mesh the module's comm is its tp group even at tp=1: the gradient norm and checkpoints then run as
    # collectives (over norm_group, the world), not as one process's.
    module_comm = tp_comm or (TorchComm(mesh.tp_group) if mesh is not None else None)
    parts = RankParts(built.plan, options, module_comm, stream, InputSpec.of(graphs[True], built.plan), names, dp,
                      rank_config(getattr(built.model, "config", None), options), built.model.training, None)
    return facing(ContextParallelModule(parts, modules, mesh), built.model)
