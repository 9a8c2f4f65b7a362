"""The context-parallel module: this rank's whole model (every parameter whole), its graphs rewritten to compute
its own chunks of every sequence (``rewrite.context_graph``), exchanging over the cp ranks."""

from __future__ import annotations

import torch

from autotp.errors import InputError
from autotp.planning.context_plan import plan_context
from autotp.rewrite import build_graph, materialise_all
from autotp.rewrite.comm import TorchComm
from autotp.rewrite.context_graph import apply_context
from autotp.rewrite.dtypes import cast_for_policy
from autotp.rewrite.streams import RankStream
from autotp.runtime.parallel_base import RankParts
from autotp.runtime.input_spec import InputSpec
from autotp.runtime.integrations import facing, rank_config
from autotp.runtime.process import from_first_rank, shared_seed
from autotp.runtime.state import state_names
from autotp.runtime.tensor_module import ParallelModule


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


def context_parallel(built, group, distributed: bool) -> ParallelModule:
    """This rank's context-parallel module of ``built`` (an ``api.Built`` whose options have cp > 1) over
    ``group`` (default: the world, whose ranks are the cp ranks)."""
    if not distributed:
        raise InputError(f"cp={built.options.cp} needs a process group of cp ranks; use autotp.check to simulate "
                         "them in one process")
    comm = TorchComm(group)
    stream = RankStream(shared_seed(group, distributed))
    source = built.source or from_first_rank(built.model, group, distributed)
    graphs = built.graphs
    modules = {mode: build_graph(captured, built.plan, 0, None) for mode, captured in graphs.items()}
    for gm in modules.values():
        cast_for_policy(gm, built.options)
    materialise_all([(modules[mode], graphs[mode]) for mode in modules], built.plan, 0, source=source)
    for mode, gm in modules.items():
        layout = plan_context(graphs[mode], comm.size, built.options.cp_exchange, built.options.memory_budget)
        apply_context(gm, layout, comm, {n for n, p in gm.named_parameters() if p.requires_grad})
    names = state_names(built.model, graphs[True], modules.values(), source)
    parts = RankParts(built.plan, built.options, None, stream, InputSpec.of(graphs[True], built.plan), names, None,
                      rank_config(getattr(built.model, "config", None), built.options), built.model.training,
                      None)
    return facing(ParallelModule(parts, modules, NoGeneration(), None), built.model)
