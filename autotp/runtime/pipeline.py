"""The pipeline runtime: stages on a (pp × dp × tp) DeviceMesh, driven by torch.distributed.pipelining.

Each rank holds the stages the schedule places on its pipeline rank (``Schedule.rank_of``: ``i % pp``, or a V
for ZBV and DualPipeV; one stage, or several for the interleaved and V schedules), each already tensor-parallel
over its ``tp`` group. A weight tied across stages (the embedding and the LM head) is held by both; their
gradients are summed after each backward. With data parallelism each (dp) replica runs its own pipeline on its
slice of the batch; under fsdp each stage is an FSDP unit, which torch's schedules drive (gradients
reduce-scattered once, after the last microbatch).
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import product

import torch
import torch.distributed as dist
from torch import fx, nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
)
from autotp.torch_private.pytree import tree_unflatten

from autotp.capture import name_inputs
from autotp.capture.core.kv_cache import PIPELINE_NOTE
from autotp.errors import InputError, PlanError
from autotp.options import Schedule
from autotp.rewrite.comm import TorchComm
from autotp.rewrite.grad_bucket import expect_only, grad_buckets, held
from autotp.runtime.batch_agreement import check_same_inputs
from autotp.runtime.data_parallel import DataParallel, check_unshared, local, unsharded
from autotp.runtime.integrations import RefusesDDP
from autotp.runtime.mesh import Mesh, global_rank
from autotp.runtime.loss import step_loss, without_loss
from autotp.runtime.outputs import SplitOutputs, deferred, output_gathers
from autotp.runtime.parallel_base import ParallelBase, RankParts, checked_scale
from autotp.runtime.peers import group_timeout, guarded


_SCHEDULES = {Schedule.GPIPE: ScheduleGPipe, Schedule.ONE_F_ONE_B: Schedule1F1B,
              Schedule.INTERLEAVED_1F1B: ScheduleInterleaved1F1B,
              Schedule.INTERLEAVED_ZERO_BUBBLE: ScheduleInterleavedZeroBubble, Schedule.ZBV: ScheduleZBVZeroBubble,
              Schedule.DUALPIPE_V: ScheduleDualPipeV}
"""Torch's schedule class for each of ours."""


def tied_groups(stage_graphs: list[fx.GraphModule], mesh: Mesh) -> dict[str, object]:
    """A process group per parameter read by several stages, joining the ranks that hold it.

    Every rank must create every group, in the same order, even those it is not in.
    """
    readers: dict[str, set[int]] = {}
    for index, gm in enumerate(stage_graphs):
        params = dict(gm.named_parameters())
        for node in gm.graph.find_nodes(op="get_attr"):
            if node.target in params:
                readers.setdefault(node.target, set()).add(index)
    groups: dict[str, object] = {}
    for target in sorted(t for t, stages in readers.items() if len(stages) > 1):
        holders = {mesh.placement(s, mesh.pp) for s in readers[target]}
        if len(holders) < 2:
            continue  # one rank holds every copy: they are one shared tensor already
        for dp_rank, cp_rank, tp_rank in product(range(mesh.dp), range(mesh.cp), range(mesh.tp)):
            ranks = sorted(global_rank(p, dp_rank, tp_rank, mesh.dp, mesh.tp, cp_rank, mesh.cp) for p in holders)
            group = dist.new_group(ranks, timeout=group_timeout())
            if dist.get_rank() in ranks:
                groups[target] = group
    return groups


def _refuse_own_loss(target, kwargs: dict) -> None:
    """Pipelines train on ``loss_fn(output, target)`` only. A model's own loss (``labels=``) is a mean over
    the tokens each microbatch leaves unmasked; the mean of those means is not the batch's mean when the
    microbatches hold different numbers of unmasked tokens, so it would not be exact."""
    if "labels" in kwargs:
        raise InputError("labels= (the model's own loss) is not supported with pipeline parallelism (pp > 1): the "
                         "loss is computed per microbatch, and a mean over each microbatch's unmasked tokens does "
                         "not average to the batch's; pass target= (and loss_fn) instead, or use pp=1")
    if target is None:
        raise InputError("step needs target= with pipeline parallelism (the last stage computes "
                         "loss_fn(output, target) per microbatch; default loss_fn: cross-entropy of the logits)")


class PipelineModule(RefusesDDP, ParallelBase):
    """This rank's stages of a tensor- and pipeline-parallel model.

    ``step`` trains through the schedule on the train-mode stages; ``forward`` runs the train- or eval-mode
    stages as the module's mode says. Random ops draw from one stream per rank: values kept whole stay
    identical across the tensor-parallel ranks of a stage, but a rank's stream does not see the draws of
    the other stages' ranks, so the masks differ from a single process's.
    """

    def __init__(self, parts: RankParts, stages: dict[bool, dict[int, fx.GraphModule]], mesh: Mesh, out_spec,
                 tied: dict[str, object]):
        super().__init__(parts)
        self.stages = nn.ModuleDict({str(i): m for i, m in stages[True].items()})
        self.eval_stages = nn.ModuleDict({str(i): m for i, m in stages[False].items()})
        self.mesh, self._out_spec, self._tied = mesh, out_spec, tied
        self.schedule, self.microbatches = parts.options.schedule, parts.options.step_microbatches
        self.num_stages = len(self.plan.stages)
        self._units = _fsdp_units(stages, self._dp)
        """Stage index -> its FSDP unit (not a registered child: the schedule always runs the train graph)."""
        self._pipeline_stages = [PipelineStage(self._units.get(i, m), i, self.num_stages, mesh.device,
                                               group=mesh.pp_group) for i, m in stages[True].items()]
        self._schedule = None
        self._loss_fn: Callable | None = None
        self._backward_scale = 1.0
        self._output_gathers = output_gathers(self.stages.values())
        self._split: SplitOutputs | None = None
        """The outputs the running step left split (its last stage's output gathers are deferred)."""
        # Every rank of a replica (its tp and pp ranks) must be given one batch: the first stage reads the inputs,
        # the last the target. Without replicas that is the whole world; with them, the tp group is checked.
        self._replica = TorchComm(None) if mesh.dp == 1 else self.comm
        self._buckets = grad_buckets([*self.stages.values(), *self.eval_stages.values()])
        expect_only(self._buckets, self.stages.values())  # a step's last backward carries this rank's shares
        if self._dp is not None:
            self._dp.take_buckets(self._buckets, pipelined=True, modules=list(self.stages.values()))
        self._start(parts.training)

    def rank_modules(self) -> list[fx.GraphModule]:
        """The train-mode stages this rank holds (the eval-mode ones share their tensors)."""
        return list(self.stages.values())

    def _is_first_holder(self, target: str) -> bool:
        # A weight several stages read (tied embedding and head) counts once, on the first rank holding it.
        return target not in self._tied or dist.get_rank(self._tied[target]) == 0

    def _collect_stages(self, mine: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        everyone: list = [None] * self.mesh.pp
        dist.all_gather_object(everyone, {n: t.cpu() for n, t in mine.items()}, group=self.mesh.pp_group)
        full: dict[str, torch.Tensor] = {}
        for part in everyone:
            for name, tensor in part.items():
                full.setdefault(name, tensor)
        return full

    @property
    def holds_first(self) -> bool:
        return "0" in self.stages

    @property
    def holds_last(self) -> bool:
        return str(self.num_stages - 1) in self.stages

    def _make_schedule(self):
        """The schedule, built once: building one runs a forward and backward to infer shapes."""
        def flat_loss(output, target):
            # The last stage returns the model's outputs flattened; the user's loss sees them as the model's.
            leaves = [output] if isinstance(output, torch.Tensor) else list(output)  # 1-tuples arrive unwrapped
            loss = step_loss(tree_unflatten(leaves, self._out_spec), target, self._loss_fn, self._split)
            return loss * self._backward_scale

        cls = _SCHEDULES[self.schedule]
        stages = self._pipeline_stages if self.schedule.virtual else self._pipeline_stages[0]
        # scale_grads=False: torch divides each stage's gradients as that stage finishes, so a weight two stages
        # on one rank share (a tied embedding and head in a V) would be divided twice, or before its last part
        # is added, and gradients accumulated by an earlier step would be divided too; the loss is scaled instead.
        return cls(stages, self.microbatches, loss_fn=flat_loss, scale_grads=False)

    def _check_batch(self, inputs) -> None:
        batch = inputs[0].shape[0]
        if batch % self.microbatches:
            raise InputError(f"batch size {batch} is not divisible by microbatches={self.microbatches}; "
                             "use a batch that is a multiple of it, or change microbatches")

    def step(self, *inputs, target: torch.Tensor | None = None, loss_fn: Callable | None = None,
             loss_scale: float = 1.0, **kwargs) -> torch.Tensor:
        """Forward and backward over the microbatches; returns the full-batch loss on every rank.

        The inputs may be positional or keyword, as the model takes them. The loss is the mean of the
        microbatch losses (equal sizes): exact for mean-reduced losses, matching the gradients, which the
        schedule averages over microbatches. ``target`` is required: see ``_refuse_own_loss``. With data
        parallelism each replica passes its own slice and gets its slice's loss; gradients are averaged over
        the replicas. Gradients are added to those already there: over k accumulated steps pass ``loss_scale=1/k``
        (the backward is of the loss times ``loss_scale``; the returned loss is unscaled).
        """
        scale = checked_scale(loss_scale)
        self._check_adapters_off()  # a step does not run the forward's hooks
        with guarded("step"):
            return self._step(inputs, kwargs, target, loss_fn, scale)

    def _step(self, inputs: tuple, kwargs: dict, target, loss_fn, scale: float) -> torch.Tensor:
        _refuse_own_loss(target, kwargs)
        inputs = self._inputs.arrange(inputs, kwargs)
        # Completed before the schedule runs, not overlapped with it (as the tensor-parallel module's is): the
        # stages' sends go through torch.distributed, not the communicator that would complete the check first.
        check_same_inputs((*self._inputs.names, "target"), (*inputs, target), self._replica)
        self._check_batch(inputs)
        self._loss_fn = loss_fn
        # Each microbatch's loss backward is scaled so the step adds the mean over microbatches (times the scale).
        self._backward_scale = scale / self.microbatches
        losses: list[torch.Tensor] = []
        args = inputs if self.holds_first else ()
        kwargs = {"target": target, "losses": losses} if self.holds_last else {}
        # The schedule is built (its shapes and dtypes inferred) and run under the policy's autocast alike.
        # one sum of the adapters' gradient shares for the step, not one per microbatch's backward
        with held(self._buckets, self.microbatches), deferred(self._output_gathers) as self._split, self.precision_autocast():
            if self._schedule is None:
                self._schedule = self._make_schedule()
            self._schedule.step(*args, **kwargs)
        self._split = None
        self.average_gradients()
        self._sum_tied_grads()
        loss = (torch.stack(losses).sum() / scale).detach() if self.holds_last else torch.zeros((), device=self.mesh.device)
        dist.broadcast(loss, src=self.mesh.rank_of(self.num_stages - 1), group=self.mesh.pp_group)
        return loss

    def _sum_tied_grads(self) -> None:
        held = {k: p for m in self.stages.values() for k, p in m.named_parameters()}
        for target, group in self._tied.items():
            grad = held[target].grad
            if grad is None:
                grad = held[target].grad = torch.zeros_like(held[target])
            dist.all_reduce(local(grad), group=group)  # the holders' FSDP shards line up: same dp rank

    def generate(self, *args, **kwargs):
        """Refused: generation runs tensor-parallel graphs with a KV cache split over tp, not pipeline stages."""
        raise PlanError(f"{PIPELINE_NOTE} (this module's plan has pp={self.plan.pp}: tp={self.plan.tp * self.plan.pp} "
                        "with pp=1)")

    @torch.no_grad()
    def forward(self, *inputs, **kwargs):
        """The model's output (without autograd history), on every rank; runs the stages in turn."""
        with guarded("forward"):
            return self._forward(inputs, kwargs)

    def _forward(self, inputs: tuple, kwargs: dict):
        dropped = self._inputs.fills_labels(name_inputs(self._inputs.signature, inputs, kwargs))
        inputs = self._inputs.arrange(inputs, kwargs, stand_in_labels=True)
        check_same_inputs(self._inputs.names, inputs, self._replica)
        stages = self.stages if self.training else self.eval_stages
        hidden = None
        outputs = None
        for index in range(self.num_stages):
            if str(index) in stages:
                module = stages[str(index)]
                with unsharded([self._units[index]] if index in self._units else []), self.precision_autocast():
                    result = module(*inputs) if index == 0 else module(hidden, *inputs)
                if index == self.num_stages - 1:
                    outputs = list(result)
                else:
                    hidden = result[0]
                    self._send(hidden, index + 1)
            elif str(index + 1) in stages and index + 1 < self.num_stages:
                hidden = self._recv(index, index + 1)
        box = [outputs]
        dist.broadcast_object_list(box, src=self.mesh.rank_of(self.num_stages - 1), group=self.mesh.pp_group)
        output = tree_unflatten(box[0], self._out_spec)
        return without_loss(output) if dropped else output  # called without labels: as the model, no loss

    def _send(self, hidden: torch.Tensor, to_stage: int) -> None:
        dst = self.mesh.rank_of(to_stage)
        if dst == dist.get_rank():
            return
        # Over the pp group, made with parallelize's timeout (the default group may be the caller's).
        dist.send(torch.tensor(hidden.shape, dtype=torch.long, device=hidden.device), dst=dst, group=self.mesh.pp_group)
        dist.send(hidden.contiguous(), dst=dst, group=self.mesh.pp_group)

    def _recv(self, from_stage: int, to_stage: int) -> torch.Tensor:
        module = self.stages[str(to_stage)]  # the train and eval stages take the same hidden state
        meta = next(iter(module.graph.find_nodes(op="placeholder"))).meta["val"]
        shape = torch.empty(meta.dim(), dtype=torch.long, device=self.mesh.device)
        dist.recv(shape, src=self.mesh.rank_of(from_stage), group=self.mesh.pp_group)
        hidden = torch.empty(tuple(shape.tolist()), dtype=meta.dtype, device=self.mesh.device)
        dist.recv(hidden, src=self.mesh.rank_of(from_stage), group=self.mesh.pp_group)
        return hidden

    def close(self) -> None:
        """Release the process groups this module holds (done at exit); it cannot communicate afterwards."""
        self.comm.close()
        self._pipeline_stages, self._schedule, self._tied, self._units = [], None, {}, {}
        self.mesh.close()


def _fsdp_units(stages: dict[bool, dict[int, fx.GraphModule]], dp: DataParallel | None) -> dict[int, nn.Module]:
    """Each stage's train and eval graphs as one FSDP unit (fsdp); none otherwise."""
    if dp is None or not dp.sharded:
        return {}
    check_unshared(stages[True])
    return {i: dp.wrap(gm, stages[False][i]) for i, gm in stages[True].items()}
