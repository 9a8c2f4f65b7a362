"""The two entry points: ``plan`` (no process group needed) and ``parallelize``.

They connect the stages: capture → passes and planning → rewrite → runtime.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
from torch import nn

from autotp.capture import Captured, ExampleInputs, capture, example_inputs_of
from autotp.errors import InputError
from autotp.options import Balance, DataParallelMode, Schedule, VocabChoice
from autotp.passes.analysis import Analysis
from autotp.planning import Plan, check_plan_fits, make_plan
from autotp.planning.choose import Choices, machine_for, parse_bytes
from autotp.planning.planner import verify_plan
from autotp.rewrite import Source, build_graph, materialise_all, split_stages
from autotp.rewrite.comm import TorchComm
from autotp.rewrite.random import RankStream
from autotp.runtime import (
    DataParallel,
    Mesh,
    ParallelModule,
    PipelineModule,
    check_same_plan,
    check_world,
    device_for,
    ensure_process_group,
    state_names,
    tied_groups,
)
from autotp.runtime.generation import Generation
from autotp.runtime.inputs import InputSpec
from autotp.runtime.process import first_rank, from_first_rank, shared_seed
from autotp.runtime.sources import checkpoint_source

_MEANING = {"tp": "the number of tensor-parallel ranks", "pp": "the number of pipeline stages' ranks",
            "virtual_stages": "pipeline stages per rank", "microbatches": "microbatches per step",
            "dp": "the number of data-parallel replicas"}


def _check_positive(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InputError(f"{name} must be a positive integer ({_MEANING[name]}), got {value!r}")
    return value


def _choice(kind, name: str, value):
    """``value`` as a member of the enum ``kind``, or an ``InputError`` listing the choices."""
    try:
        return kind(value)
    except ValueError as e:
        raise InputError(f"{name} must be one of {[c.value for c in kind]}, got {value!r}") from e


def choices_of(vocab: str, memory_budget, device, sequence_parallel: bool = False) -> Choices:
    """What the planner may choose (``vocab``, ``memory_budget``), priced for ranks on ``device`` (None: this
    process's kind), and whether it splits the sequence."""
    if not isinstance(sequence_parallel, bool):
        raise InputError(f"sequence_parallel must be True or False, got {sequence_parallel!r}")
    return Choices(_choice(VocabChoice, "vocab", vocab), parse_bytes(memory_budget), machine_for(device),
                   sequence_parallel)


def with_input_note(chosen: Plan, example: ExampleInputs) -> Plan:
    """``chosen``, noting that its example inputs were synthesised (the plan was made from guessed inputs)."""
    return chosen.replace(notes=(*chosen.notes, example.synthesised)) if example.synthesised else chosen


def plan(model: nn.Module, tp: int, example_inputs=None, pp: int = 1, balance: str = "both",
         batch: int | None = None, seq: int | None = None, cuts=(), virtual_stages: int = 1, vocab: str = "auto",
         memory_budget: int | str | None = None, sequence_parallel: bool = False) -> Plan:
    """The plan for ``model`` at ``tp`` tensor- and ``pp`` pipeline-parallel ranks, with no process group.

    ``example_inputs`` is what the model is captured on: a tensor, a tuple of positional tensors, or a dict of
    keyword tensors (``{"input_ids": ids, "attention_mask": mask}``); left out, token ids are synthesised from
    the model's vocabulary (``config.vocab_size``, else its largest embedding) and the plan's notes say so.
    Stage costs are evaluated at ``batch``/``seq`` (default: the example's); ``cuts`` names modules that
    must start a stage; ``virtual_stages`` > 1 plans pp × virtual_stages stages (interleaved schedules).
    ``vocab`` is ``auto`` (split the embedding and LM head along the vocabulary where the cost model finds
    that faster at ``batch``/``seq``, or where whole they would not fit ``memory_budget``: bytes per rank for
    parameters, gradients and AdamW moments, e.g. ``"40GiB"``), ``split`` (always, as Megatron) or ``whole``.
    ``sequence_parallel`` splits the residual stream between regions along the sequence (Megatron's sequence
    parallelism: norms, dropout and residual adds per sequence shard; reduce-scatters and all-gathers instead of
    all-reduces); inputs then need a sequence length that tp divides.
    """
    tp, pp = _check_positive("tp", tp), _check_positive("pp", pp)
    stages = pp * _check_positive("virtual_stages", virtual_stages)
    example = example_inputs_of(model, example_inputs)
    chosen = make_plan(capture(model, example), tp, pp=pp, balance=_choice(Balance, "balance", balance), batch=batch,
                       seq=seq, cuts=tuple(cuts), stages=stages,
                       choices=choices_of(vocab, memory_budget, None, sequence_parallel))
    return with_input_note(chosen, example)


def parallelize(model: nn.Module, tp: int | None = None, example_inputs=None, pp: int | None = None,
                plan: Plan | None = None, group=None,
                microbatches: int | None = None, schedule: str = "1f1b", balance: str = "both", cuts=(),
                virtual_stages: int | None = None, timeout: float | timedelta | None = None,
                checkpoint: str | os.PathLike | None = None, quiet: bool = False, dp: int = 1,
                dp_mode: str = "fsdp", vocab: str = "auto", memory_budget: int | str | None = None,
                compile: bool = False, sequence_parallel: bool = False):
    """This rank's piece of ``model``, tensor-parallel over ``tp`` ranks, pipelined over ``pp`` and replicated
    over ``dp`` data-parallel replicas (ranks on a (pp, dp, tp) mesh, tp innermost).

    ``example_inputs`` are as for ``plan`` (a tensor, a tuple, a dict of keyword tensors, or left out for
    synthesised token ids); the module then takes the same inputs, positionally or by name
    (``pm(input_ids=ids, attention_mask=mask)``), and ``pm.step(..., labels=labels)`` trains on the model's
    own loss when labels were among the example inputs (tensor parallelism only).
    The model itself is left untouched; every rank's shards come from the first rank's copy. Uses
    ``group`` if given (pp == 1 only), else the default process group, initialised from torchrun's
    environment when needed (``timeout``, seconds, bounds how long a collective waits for the other ranks;
    default 10 minutes). With ``plan`` given, applies it instead of planning (``tp`` and ``pp`` then
    default to the plan's). With pp > 1, ``step`` runs ``microbatches`` (default pp) through the
    ``schedule`` (``gpipe``, ``1f1b`` or ``interleaved1f1b`` with ``virtual_stages`` stages per rank);
    1F1B schedules need at least as many microbatches as stages (the default).

    With ``checkpoint`` (a ``.safetensors`` file, a Hugging Face model directory, or a directory ``pm.save``
    wrote at any layout), every rank reads only its own slices of the weights from it, and the model may be on
    the meta device (built under ``autotp.empty_weights()``, accelerate's ``init_empty_weights()`` or
    ``torch.device("meta")``): it never exists whole. The first rank draws a progress bar unless ``quiet``.
    With ``dp`` > 1 each replica (``pm.dp_rank`` of ``pm.dp_size``) trains on its own slice of the global batch
    and gradients are averaged over the replicas; ``dp_mode`` is ``fsdp`` (FSDP2 ``fully_shard`` over the
    replicas: parameters, gradients and optimizer state sharded) or ``replicate`` (gradient all-reduce).
    ``vocab``, ``memory_budget`` and ``sequence_parallel`` are as for ``plan`` (costs at the example inputs' batch
    and sequence).
    ``compile`` runs the rank's graphs under ``torch.compile`` (tensor parallelism only: pp = dp = 1); the first
    call of each mode (forward, step) compiles, a new input size may compile again.
    """
    if plan is not None and isinstance(plan, Plan):
        tp, pp = tp or plan.tp, pp or plan.pp
    tp, pp = _check_positive("tp", tp), _check_positive("pp", pp or 1)
    sched = _choice(Schedule, "schedule", schedule)
    default_virtual = 2 if sched is Schedule.INTERLEAVED_1F1B else 1
    if isinstance(plan, Plan) and plan.stages:
        default_virtual = max(1, len(plan.stages) // pp)
    virtual = _check_positive("virtual_stages", virtual_stages or default_virtual)
    dp, dp_mode = _check_positive("dp", dp), _choice(DataParallelMode, "dp_mode", dp_mode)
    if compile and (pp > 1 or dp > 1):
        raise InputError(f"compile=True runs tensor-parallel graphs (pp=1, dp=1) under torch.compile; with pp={pp} "
                         f"and dp={dp} the pipeline schedule and FSDP's hooks wrap them: leave compile off there")
    if (pp > 1 or dp > 1) and group is not None:
        raise InputError("pp > 1 or dp > 1 lays ranks out on a (pp x dp x tp) mesh over the default process group; "
                         "do not pass group")
    example = example_inputs_of(model, example_inputs)
    if checkpoint is None:
        _check_materialised(model)
    distributed = ensure_process_group(tp * pp * dp, timeout)
    check_world(group, distributed, tp, pp, dp)
    source = None
    if checkpoint is not None:  # checked against the model now, before anything is captured
        source = checkpoint_source(checkpoint, model, first_rank(group, distributed) and not quiet)
    graphs = {mode: capture(model, example, training=mode) for mode in (True, False)}
    captured = graphs[True]
    stages = pp * virtual
    if plan is not None:
        chosen = verify_plan(captured, check_plan_fits(plan, param_shapes(model), tp, pp, stages))
    else:
        choices = choices_of(vocab, memory_budget, device_for(group, distributed) or "cpu", sequence_parallel)
        chosen = with_input_note(make_plan(captured, tp, pp=pp, balance=_choice(Balance, "balance", balance),
                                           cuts=tuple(cuts), stages=stages, choices=choices), example)
    check_same_plan(chosen, group, distributed)
    if pp == 1:
        return _tensor_parallel(model, graphs, chosen, group, distributed, source, _data_parallel(dp, tp, dp_mode),
                                compile)
    micro = _check_positive("microbatches", microbatches or stages)
    if sched is not Schedule.GPIPE and micro < stages:
        raise InputError(f"schedule {sched.value} needs at least {stages} microbatches (one per stage) to fill the "
                         f"pipeline, got microbatches={micro}; raise microbatches or use schedule='gpipe'")
    return _pipeline_parallel(model, graphs, chosen, sched, micro, source, dp, dp_mode)


def param_shapes(model: nn.Module) -> dict[str, tuple]:
    """Every parameter's shape, tied ones under each of their names (what a plan may name)."""
    return {name: tuple(p.shape) for name, p in model.named_parameters(remove_duplicate=False)}


def _check_materialised(model: nn.Module) -> None:
    """Parameters on the meta device have no values to shard: say so before anything runs."""
    meta = [name for name, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if meta:
        raise InputError(f"{len(meta)} parameter(s)/buffer(s) are on the meta device (no values), e.g. {meta[0]}; "
                         "autotp.plan plans such a model, but parallelize needs weights: pass checkpoint= (a "
                         ".safetensors file, a Hugging Face directory or a pm.save directory) or build the model on "
                         "the CPU")


def _data_parallel(dp: int, tp: int, mode: DataParallelMode) -> DataParallel | None:
    """Tensor parallelism's replicas on a (1, dp, tp) mesh over the default group; None for dp=1 (as before)."""
    if dp == 1:
        return None
    return DataParallel(Mesh(1, tp, device_for(None, True) or torch.device("cpu"), dp=dp), mode)


def _tensor_parallel(model: nn.Module, graphs: dict[bool, Captured], chosen: Plan, group,
                     distributed: bool, source: Source | None, dp: DataParallel | None = None,
                     compile: bool = False) -> ParallelModule:
    comm = TorchComm(dp.mesh.tp_group if dp is not None else group) if distributed else None
    rank = comm.rank if comm is not None else 0
    stream = RankStream(shared_seed(group, distributed))
    source = source or from_first_rank(model, group, distributed)
    modules = {mode: build_graph(captured, chosen, rank, comm, stream=stream) for mode, captured in graphs.items()}
    materialise_all([(modules[mode], graphs[mode]) for mode in modules], chosen, rank, source=source)
    device = device_for(group, distributed)
    if device is not None:
        for gm in modules.values():
            gm.to(device)  # NCCL communicates GPU tensors; inputs must then be on this device too
    pm = ParallelModule(modules, chosen, comm, state_names(model, graphs[True], modules.values(), source), stream,
                        InputSpec.of(graphs[True], chosen), model.training, dp, compile)
    pm.model_config = getattr(model, "config", None)
    pm.generation = Generation(model)
    return pm


def _pipeline_parallel(model: nn.Module, graphs: dict[bool, Captured], chosen: Plan, sched: Schedule,
                       microbatches: int, source: Source | None, dp: int = 1,
                       dp_mode: DataParallelMode = DataParallelMode.FSDP) -> PipelineModule:
    device = device_for(None, True) or torch.device("cpu")
    mesh = Mesh(chosen.pp, chosen.tp, device, dp=dp)
    comm, stream = TorchComm(mesh.tp_group), RankStream(shared_seed(None, True))
    source = source or from_first_rank(model, None, True)
    stages: dict[bool, dict[int, torch.fx.GraphModule]] = {}
    for mode, captured in graphs.items():
        analysis = Analysis(captured)
        gm = build_graph(captured, chosen, mesh.tp_rank, comm, analysis, stream)
        every = split_stages(gm, analysis, chosen, list(range(len(chosen.stages))))
        if mode:
            names, tied = state_names(model, captured, every, source), tied_groups(every, mesh)
        stages[mode] = {i: g for i, g in enumerate(every) if i % chosen.pp == mesh.pp_rank}
    materialise_all([(g, graphs[mode]) for mode in stages for g in stages[mode].values()], chosen, mesh.tp_rank,
                    source=source)
    for held in stages.values():
        for g in held.values():
            g.to(device)
    pm = PipelineModule(stages, chosen, mesh, names, graphs[True].out_spec, tied, sched, microbatches, comm, stream,
                        InputSpec.of(graphs[True], chosen), model.training, DataParallel(mesh, dp_mode) if dp > 1 else None)
    pm.model_config = getattr(model, "config", None)
    return pm
