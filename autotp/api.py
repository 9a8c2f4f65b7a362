"""The two entry points: ``plan`` (no process group needed) and ``parallelize``.

They connect the stages: capture → passes and planning → rewrite → runtime.
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from autotp.capture import ExampleInputs, capture, capture_repeated, example_inputs_of
from autotp.errors import InputError, RuntimeSetupError
from autotp.options import Options, Recompute, capture_speedups
from autotp.passes.placement import Source
from autotp.plan_choice import Search, choose_plan, required_tp, search_options
from autotp.planning.ep_runtime import refuse_unrunnable_ep
from autotp.planning import Plan
from autotp.planning.machines import machine_for, machine_named
from autotp.planning.plan import check_schedule_fits
from autotp.rewrite import build_graph, materialise_all, split_stages
from autotp.rewrite.cache_layout import build_cache_steps
from autotp.rewrite.comm import TorchComm
from autotp.runtime.expert_groups import expert_ranks, reduce_experts_over_replicas
from autotp.rewrite.dtypes import cast_for_policy
from autotp.rewrite.local_reads import distribute
from autotp.rewrite.loss_graph import build_loss_graph
from autotp.rewrite.recompute import recompute_blocks
from autotp.rewrite.streams import RankStream
from autotp.runtime import (
    DataParallel,
    Mesh,
    ParallelModule,
    PipelineModule,
    RankParts,
    check_same_plan,
    check_world,
    device_for,
    ensure_process_group,
    state_names,
    tied_groups,
)
from autotp.context_parallel import context_parallel
from autotp.context_pipeline import ContextPipelineModule, context_stages
from autotp.runtime.generation import Generation, for_generation
from autotp.runtime.peft_adapters import PeftInfo
from autotp.runtime.input_spec import InputSpec
from autotp.runtime.integrations import facing, rank_config
from autotp.runtime.loss import LossGraphs
from autotp.runtime.peers import as_timedelta, bound_groups, group_timeout
from autotp.runtime.process import first_rank, from_first_rank, shared_seed
from autotp.runtime.process import world_size as group_size
from autotp.runtime.readers import checkpoint_source
from autotp.runtime.tp_params import expressible, layout_of, shared_holders, tp_layout, tp_mesh, tp_mesh_2d, warn_plain


def plan(model: nn.Module, tp: int | None = None, example_inputs=None, *, options: Options | None = None,
         world_size: int | None = None, machine: str | None = None, **settings) -> Plan:
    """The plan for ``model`` at ``tp`` tensor-parallel ranks (and the other settings), with no process group.

    ``example_inputs`` is what the model is captured on: a tensor, a tuple of positional tensors, or a dict of
    keyword tensors (``{"input_ids": ids, "attention_mask": mask}``); left out, token ids are synthesised from
    the model's vocabulary (``config.vocab_size``, else its largest embedding) and the plan's notes say so.
    ``settings`` are ``autotp.Options`` fields (``pp``, ``cp``, ``balance``, ``batch``, ``seq``, ``cuts``,
    ``virtual_stages``, ``vocab``, ``memory_budget``, ``sequence_parallel``; each documented there), applied
    over ``options`` if given. Stage costs are evaluated at ``batch``/``seq`` (default: the example's).
    With ``world_size`` the planner chooses the layout of that many devices (see ``parallelize``) on ``machine``
    (a name from ``autotp.planning.machines.MACHINES``: ``cpu``, ``h100``, ``h200``, ``a100``; default: this one).
    """
    example = example_inputs_of(model, example_inputs)
    # Planning reads shapes and structure only, so identical blocks are captured once and stamped out
    # (``capture_repeated``: the same graph, checked, or the full capture); the rewrite captures in full.
    captured = capture_repeated(model, example, speedups=capture_speedups(options, settings))
    hardware = machine_named(machine) if machine is not None else machine_for()
    if world_size is not None:
        return choose_plan(model, captured, example, hardware,
                           search=search_options(tp, options, settings, world_size))
    chosen_options = Options.build(options, tp=required_tp(tp, options, settings.get("cp")), **settings)
    return choose_plan(model, captured, example, hardware, options=chosen_options)


def parallelize(model: nn.Module, tp: int | None = None, example_inputs=None, *, plan: Plan | None = None,
                group=None, timeout: float | timedelta | None = None, checkpoint: str | os.PathLike | None = None,
                quiet: bool = False, strict: bool = True, verify: bool = True, options: Options | None = None,
                world_size: int | None = None, **settings):
    """This rank's piece of ``model``, tensor-parallel over ``tp`` ranks, pipelined over ``pp`` and replicated
    over ``dp`` data-parallel replicas (ranks on a (pp, dp, tp) mesh, tp innermost).

    ``settings`` are ``autotp.Options`` fields (``pp``, ``dp``, ``cp``, ``dp_mode``, ``microbatches``, ``schedule``,
    ``virtual_stages``, ``balance``, ``cuts``, ``vocab``, ``memory_budget``, ``sequence_parallel``,
    ``compile``; each documented there), applied over ``options`` if given.
    ``example_inputs`` are as for ``plan`` (a tensor, a tuple, a dict of keyword tensors, or left out for
    synthesised token ids); the module then takes the same inputs, positionally or by name
    (``pm(input_ids=ids, attention_mask=mask)``), and ``pm.step(..., labels=labels)`` trains on the model's
    own loss when labels were among the example inputs (tensor parallelism only).
    The model itself is left untouched; every rank's shards come from the first rank's copy. Uses
    ``group`` if given (pp == 1 only), else the default process group, initialised from torchrun's
    environment when needed (``timeout``, seconds, bounds how long a collective waits for the other ranks;
    default 10 minutes). With ``plan`` given, applies it instead of planning (``tp`` and ``pp`` then
    default to the plan's). With pp > 1, ``step`` runs ``microbatches`` (default: one per stage) through the
    ``schedule`` (``gpipe``, ``1f1b``, ``interleaved1f1b`` or ``interleavedzb`` with ``virtual_stages`` stages
    per rank, ``zbv`` or ``dualpipev`` with two per rank in a V: ``options.Schedule``); all but GPipe need at
    least as many microbatches as stages (the default).

    With ``checkpoint`` (a ``.safetensors`` file, a Hugging Face model directory, or a directory ``pm.save``
    wrote at any layout), every rank reads only its own slices of the weights from it, and the model may be on
    the meta device (built under ``autotp.empty_weights()``, accelerate's ``init_empty_weights()`` or
    ``torch.device("meta")``): it never exists whole. The first rank draws a progress bar unless ``quiet``.
    The checkpoint's files are checked against the manifest ``pm.save`` wrote (``verify=False`` skips that), and its
    tensors against the model: one ``CheckpointError`` lists every tensor of another shape or kind of dtype and,
    unless ``strict=False``, every parameter or saved buffer it lacks (meta tensors must be there regardless).
    With ``dp`` > 1 each replica (``pm.dp_rank`` of ``pm.dp_size``) trains on its own slice of the global batch
    and gradients are averaged over the replicas.

    The planner chooses the layout when ``world_size`` is given, or when none of ``tp``, ``pp`` and ``dp`` is
    (under torchrun, or in an initialised process group: its size): tp, pp, dp, the dp mode, the schedule,
    microbatches and sequence parallelism are searched (``planning.layout_search``), ranked by predicted step
    time on this machine, and the fastest whose memory fits ``memory_budget`` (per device) is applied; the plan's
    ``layouts`` and notes give the runner-ups and why. Any of those settings given explicitly is kept.
    """
    world = _search_world(plan, tp, options, settings, world_size, group)
    launch = Launch(group, timeout, checkpoint, quiet, strict, verify)
    if checkpoint is None:
        _check_materialised(model)
    example = example_inputs_of(model, example_inputs)
    if world is not None:
        return _parallelize_searched(model, example, search_options(tp, options, settings, world, group), launch)
    return _parallelize(model, example, plan, _options_for(plan, options, tp, settings), launch)


@dataclass(frozen=True)
class Launch:
    """How ``parallelize`` runs this rank: the caller's group and timeout, and where the weights come from."""

    group: object
    timeout: float | timedelta | None
    checkpoint: str | os.PathLike | None
    quiet: bool
    strict: bool
    verify: bool


def _parallelize(model: nn.Module, example: ExampleInputs, plan: Plan | None, options: Options, launch: Launch,
                 graphs: dict | None = None):
    """``parallelize`` at the layout ``options`` give, applying ``plan`` (or the planner's); ``graphs``: the
    model's train- and eval-mode captures, when the caller captured them already."""
    group = launch.group
    if (options.pp > 1 or options.dp > 1) and group is not None:
        raise InputError("pp > 1 or dp > 1 lays ranks out on a (pp x dp x tp) mesh over the default process group; "
                         "do not pass group")
    tp, pp, dp, cp = options.tp, options.pp, options.dp, options.cp
    distributed = ensure_process_group(tp * pp * dp * cp, launch.timeout)
    if distributed and launch.timeout is not None:  # a group the caller made keeps its own timeout unless told
        bound_groups([group or dist.group.WORLD], as_timedelta(launch.timeout))
    check_world(group, distributed, tp, pp, dp, cp)
    source = None
    if launch.checkpoint is not None:  # checked against the model before the rewrite's captures
        source = checkpoint_source(launch.checkpoint, model, first_rank(group, distributed) and not launch.quiet,
                                   launch.strict, launch.verify, group, distributed)
    graphs = graphs or _captures(model, example, options.capture_speedups)
    chosen = choose_plan(model, graphs[True], example, machine_for(device_for(group, distributed) or "cpu"),
                         options=options, given=plan)
    check_schedule_fits(chosen, options)
    check_same_plan(chosen, group, distributed)
    built = Built(model, graphs, chosen, options, source)
    if cp > 1 and pp == 1:
        return context_parallel(built, group, distributed)
    return _tensor_parallel(built, group, distributed) if pp == 1 else _pipeline_parallel(built)


def _captures(model: nn.Module, example: ExampleInputs, speedups: bool | None) -> dict:
    """The model's train- and eval-mode graphs (``pm.train()``/``pm.eval()`` switch between them), captured with
    the capture's speed-ups or without (``Options.capture_speedups``)."""
    return {mode: capture(model, example, training=mode, speedups=speedups) for mode in (True, False)}


def _search_world(plan, tp, options, settings: dict, world_size: int | None, group) -> int | None:
    """How many devices the planner lays the model out on: ``world_size``, or with no layout given (no plan, no
    tp, pp or dp, no options) the process group's size (torchrun's WORLD_SIZE before it exists); None: the caller
    gave the layout."""
    if world_size is not None:
        if plan is not None:
            raise InputError("world_size asks the planner to choose the layout, and plan gives one: pass one of them")
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise InputError(f"world_size must be a positive integer (the devices to lay the model out on), "
                             f"got {world_size!r}")
        return world_size
    if plan is not None or tp is not None or options is not None or any(
            settings.get(k) is not None for k in ("tp", "pp", "dp", "cp")):
        return None
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(group)
    return int(os.environ["WORLD_SIZE"]) if "WORLD_SIZE" in os.environ and "RANK" in os.environ else None


def _parallelize_searched(model: nn.Module, example: ExampleInputs, search: Search, launch: Launch):
    """``parallelize`` with the layout of ``search.world`` devices the planner chooses, then applied as a plan.
    The search plans on the train-mode graph ``_parallelize`` applies, so the model is captured once per mode,
    as for an explicit layout."""
    distributed = ensure_process_group(search.world, launch.timeout)
    if group_size(launch.group, distributed) != search.world:
        raise RuntimeSetupError(f"world_size={search.world} but the process group has "
                                f"{group_size(launch.group, distributed)} ranks; launch {search.world} processes "
                                f"(torchrun --nproc-per-node {search.world})")
    graphs = _captures(model, example, search.options.capture_speedups)
    machine = machine_for(device_for(launch.group, distributed) or "cpu")
    chosen = choose_plan(model, graphs[True], example, machine, search=search)
    refuse_unrunnable_ep(chosen.options, search.world)
    return _parallelize(model, example, chosen, _options_for(chosen, chosen.options, None, {}), launch, graphs)


def _options_for(plan: Plan | None, options: Options | None, tp: int | None, settings: dict) -> Options:
    """The options ``parallelize`` runs with: ``settings`` over ``options``; with a plan, its layout (tp, pp and
    stages per rank) and the options it records are the defaults."""
    base = options
    if plan is None:
        tp = required_tp(tp, options, settings.get("cp"))
    if isinstance(plan, Plan):
        layout = {"tp": plan.tp, "pp": plan.pp}
        if plan.stages:
            layout["virtual_stages"] = max(1, len(plan.stages) // plan.pp)
        base = Options.build(base or plan.options, **layout)
    return Options.build(base, tp=tp, **settings)


@dataclass(frozen=True)
class Built:
    """What both kinds of parallel module are built from: the user's model (read, never changed), its
    train- and eval-mode captures, the plan, the options and where the weights come from."""

    model: nn.Module
    graphs: dict
    plan: Plan
    options: Options
    source: Source | None


def _check_materialised(model: nn.Module) -> None:
    """Parameters on the meta device have no values to shard: say so before anything runs."""
    meta = [name for name, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if meta:
        raise InputError(f"{len(meta)} parameter(s)/buffer(s) are on the meta device (no values), e.g. {meta[0]}; "
                         "autotp.plan plans such a model, but parallelize needs weights: pass checkpoint= (a "
                         ".safetensors file, a Hugging Face directory or a pm.save directory) or build the model on "
                         "the CPU")


def _data_parallel(options: Options, mesh: Mesh | None = None) -> DataParallel | None:
    """The data-parallel replicas (on ``mesh``, else a (1, dp, tp) mesh over the default group); None for dp=1."""
    if options.dp == 1:
        return None
    mesh = mesh or Mesh(1, options.tp, device_for(None, True) or torch.device("cpu"), dp=options.dp,
                        timeout=group_timeout())
    return DataParallel(mesh, options.dp_mode, options.mixed_precision)


def _parts(built: Built, comm, stream: RankStream, names, dp: DataParallel | None) -> RankParts:
    """What the parallel module of ``built`` is made of, besides its graphs."""
    return RankParts(built.plan, built.options, comm, stream, InputSpec.of(built.graphs[True], built.plan), names, dp,
                     rank_config(getattr(built.model, "config", None), built.options), built.model.training,
                     copy.deepcopy(getattr(built.model, "generation_config", None)), PeftInfo.of(built.model))


def _recompute(built: Built, train_graphs: list[torch.fx.GraphModule], stream: RankStream) -> None:
    """Blocks of the train-mode graphs recompute their activations in backward, if the options say so (eval
    keeps no activations)."""
    if built.options.recompute is Recompute.BLOCKS:
        for gm in train_graphs:
            recompute_blocks(gm, built.graphs[True].analysis, stream)


def _tensor_parallel(built: Built, group, distributed: bool) -> ParallelModule:
    dp = _data_parallel(built.options)
    comm = TorchComm(dp.mesh.tp_group if dp is not None else group) if distributed else None
    rank = comm.rank if comm is not None else 0
    stream = RankStream(shared_seed(group, distributed))
    source = built.source or from_first_rank(built.model, group, distributed)
    graphs = built.graphs
    experts = expert_ranks(built.options, dp.rank if dp is not None else 0, rank) if distributed else None
    ep_comm = experts.comm if experts is not None else None
    modules = {mode: build_graph(captured, built.plan, rank, comm, stream=stream, ep_comm=ep_comm)
               for mode, captured in graphs.items()}
    for gm in modules.values():
        cast_for_policy(gm, built.options)
    materialise_all([(modules[mode], graphs[mode]) for mode in modules], built.plan, rank, source=source,
                    expert_rank=experts.rank if experts is not None else None)
    if experts is not None:
        reduce_experts_over_replicas(dp, experts, [(modules[mode], graphs[mode]) for mode in modules], built.plan)
    _recompute(built, [modules[True]], stream)
    device = device_for(group, distributed)
    if device is not None:
        for gm in modules.values():
            gm.to(device)  # NCCL communicates GPU tensors; inputs must then be on this device too
    names = state_names(built.model, graphs[True], modules.values(), source)
    # at ep above tp a rank's experts are not a tp shard, which a DTensor over the tp mesh would say: plain tensors
    if comm is not None and comm.size > 1 and experts is None:
        if expressible(built.plan):
            mesh = dp.mesh.mesh["tp"] if dp is not None else tp_mesh(comm.group, device or torch.device("cpu"))
            distribute(list(modules.values()), layout_of(built.plan, names), mesh)
        else:
            _distribute_shared(built.plan, names, list(modules.values()), comm, dp, device)
    generation = Generation(built.model, build_cache_steps)
    losses = LossGraphs(built.model, build_loss_graph)
    pm = facing(ParallelModule(_parts(built, comm, stream, names, dp), modules, generation, losses), built.model)
    pm.expert_comm = ep_comm
    if for_generation(built.model, graphs[False].input_names, pm.fsdp_unit is None):
        pm.prepare_generation()  # set-up, not the first generate, pays its capture
    return pm


def _distribute_shared(plan: Plan, names, graphs: list, comm, dp, device) -> None:
    """Parameters of a plan with chunks several tp ranks hold: DTensors on the 2-D view of the tp ranks where it
    can be made (``tp_params.tp_mesh_2d``: not under fsdp), else plain, with a warning."""
    holders = shared_holders(plan)
    usable = holders and (dp is None or not dp.sharded)
    layout = tp_layout(comm.group, dp.mesh.mesh if dp is not None else None) if usable else None
    mesh = tp_mesh_2d(layout, device or torch.device("cpu"), holders, comm.group) if usable else None
    if mesh is None:
        warn_plain(plan)
        return
    distribute(graphs, layout_of(plan, names, holders), mesh)


def _pipeline_parallel(built: Built) -> PipelineModule:
    plan, graphs = built.plan, built.graphs
    device = device_for(None, True) or torch.device("cpu")
    schedule = built.options.schedule
    mesh = Mesh(plan.pp, plan.tp, device, dp=built.options.dp, timeout=group_timeout(), placement=schedule.rank_of,
                cp=built.options.cp)
    comm, stream = TorchComm(mesh.tp_group), RankStream(shared_seed(None, True))
    source = built.source or from_first_rank(built.model, None, True)
    dp = _data_parallel(built.options, mesh)
    # ep above tp: each stage dispatches over its own dp x tp ranks (Megatron's expert-model-parallel group)
    experts = expert_ranks(built.options, mesh.dp_rank, mesh.tp_rank, mesh.pp_rank)
    ep_comm = experts.comm if experts is not None else None
    stages: dict[bool, dict[int, torch.fx.GraphModule]] = {}
    for mode, captured in graphs.items():
        gm = build_graph(captured, plan, mesh.tp_rank, comm, stream, ep_comm=ep_comm)
        every = split_stages(gm, captured.analysis, plan, list(range(len(plan.stages))))
        if mode:
            names, tied = state_names(built.model, captured, every, source), tied_groups(every, mesh)
        stages[mode] = {i: g for i, g in enumerate(every) if schedule.rank_of(i, plan.pp) == mesh.pp_rank}
        for g in stages[mode].values():
            cast_for_policy(g, built.options)
    held_graphs = [(g, graphs[mode]) for mode in stages for g in stages[mode].values()]
    materialise_all(held_graphs, plan, mesh.tp_rank, source=source,
                    expert_rank=experts.rank if experts is not None else None)
    if experts is not None:
        reduce_experts_over_replicas(dp, experts, held_graphs, plan)
    if built.options.cp > 1:  # after the weights are in, before the DTensors (as without pipelines)
        context_stages(stages, graphs, plan, mesh, built.options)
    _recompute(built, list(stages[True].values()), stream)
    for held in stages.values():
        for g in held.values():
            g.to(device)
    # at ep above tp a rank's experts are not a tp shard (see _tensor_parallel): plain tensors
    if plan.tp > 1 and expressible(plan) and experts is None:
        distribute([g for held in stages.values() for g in held.values()], layout_of(plan, names), mesh.mesh["tp"])
    elif plan.tp > 1 and experts is None:
        warn_plain(plan)
    kind = ContextPipelineModule if built.options.cp > 1 else PipelineModule
    pm = kind(_parts(built, comm, stream, names, dp), stages, mesh, graphs[True].out_spec, tied)
    pm.expert_comm = ep_comm
    return pm
