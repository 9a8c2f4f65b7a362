"""What every parallel module offers, in one place: the plan and options, the loss and training step's
contract, gradient averaging and clipping, seeds, data-parallel coordinates, state dicts and checkpoints.

A kind of parallel module (tensor-parallel ``ParallelModule``, ``PipelineModule``, and later generation)
subclasses ``ParallelBase`` and adds only what differs: how it runs its graphs (``forward``, ``step``), which
modules it holds (``rank_modules``), the group its norms and gathers span, and how full tensors are collected
across its stages.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import fx, nn

from autotp.torch_private import release_groups
from autotp.errors import InputError
from autotp.options import Options
from autotp.passes.placement import PlacementKind
from autotp.planning.plan import Plan
from autotp.rewrite.comm import Communicator
from autotp.rewrite.streams import RankStream
from autotp.runtime.checkpoint import Checkpointing, Holding, holding
from autotp.runtime.data_parallel import DataParallel, gathered, local
from autotp.runtime.expert_groups import expert_rank
from autotp.runtime.grad_norm import clip_grad_norm_, is_counted
from autotp.runtime.hf_model import PretrainedModelLike
from autotp.runtime.input_spec import InputSpec
from autotp.runtime.precision import Retyped
from autotp.runtime.process import close_at_exit
from autotp.runtime.state import StateNames, gather_tp, split_param


def checked_scale(loss_scale) -> float:
    """``loss_scale`` as a float, refused unless a positive finite number."""
    if isinstance(loss_scale, bool) or not isinstance(loss_scale, (int, float)) or not 0 < loss_scale < math.inf:
        raise InputError(f"loss_scale must be a positive finite number (1/k to average k accumulated "
                         f"micro-batches), got {loss_scale!r}")
    return float(loss_scale)


@dataclass(frozen=True)
class RankParts:
    """What any parallel module is made of, besides its graphs: the plan and options it runs, its tensor-parallel
    communicator and random stream, how it takes inputs and names its state, its data-parallel replicas, and
    the original model's ``config`` (written beside a safetensors export)."""

    plan: Plan
    options: Options
    comm: Communicator | None
    """The tensor-parallel group (None: one process, no communication)."""
    stream: RankStream
    inputs: InputSpec
    names: StateNames
    dp: DataParallel | None = None
    model_config: object = None
    training: bool = True
    """The original model's mode, which the module starts in."""
    generation_config: object = None
    """A copy of the original model's ``generation_config`` (None: it has none)."""
    peft: object = None
    """The original model's peft adapters' configs and scalings (``runtime.peft_adapters.PeftInfo``; None: not a
    peft model)."""


class ParallelBase(PretrainedModelLike, Checkpointing, Retyped, nn.Module):
    """The part of a parallel module every kind shares (see the module docstring)."""

    def __init__(self, parts: RankParts):
        super().__init__()
        self.plan, self.options, self.comm = parts.plan, parts.options, parts.comm
        self.expert_comm: Communicator | None = None
        """The expert-parallel group when it is not the tp group (ep above tp; set by ``parallelize``)."""
        self.model_config, self.generation_config = parts.model_config, parts.generation_config
        self.peft = parts.peft
        self._stream, self._inputs, self._names, self._dp = parts.stream, parts.inputs, parts.names, parts.dp

    def _start(self, training: bool) -> None:
        """Finish construction: set the mode, and close the module's process groups at exit."""
        self.train(training)
        close_at_exit(self)

    # What a kind says about itself.
    def rank_modules(self) -> list[fx.GraphModule]:
        """The train-mode graphs this rank holds (their parameters are the module's)."""
        raise NotImplementedError

    @property
    def tp_rank(self) -> int:
        """This rank's index among the tensor-parallel ranks."""
        return self.comm.rank if self.comm is not None else 0

    def _norm_group(self):
        """The group a gradient norm is summed over (None: the whole world)."""
        return None

    def _is_first_holder(self, target: str) -> bool:
        """Whether this rank counts a parameter read by several of the model's stages (tied weights)."""
        return True

    def _collect_stages(self, mine: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Full tensors of every stage, from this rank's stages' full tensors (identity without pipelines)."""
        return mine

    # What every kind offers.
    @property
    def dp_rank(self) -> int:
        """This replica's index among the data-parallel replicas: feed it slice ``dp_rank`` of the global batch."""
        return self._dp.rank if self._dp is not None else 0

    @property
    def dp_size(self) -> int:
        """The number of data-parallel replicas (1 without data parallelism)."""
        return self._dp.size if self._dp is not None else 1

    def step(self, *inputs, target: torch.Tensor | None = None, loss_fn: Callable | None = None,
             loss_scale: float = 1.0, **kwargs) -> torch.Tensor:
        """Forward and backward on the inputs (positional or keyword, as the model takes them); returns the
        (detached, unscaled) loss, and the gradients of ``loss * loss_scale`` are added to ``parameters()``'
        (averaged over data-parallel replicas): ``loss_scale=1/k`` over k accumulated micro-batches trains on
        their mean."""
        raise NotImplementedError

    def loss(self, *inputs, target: torch.Tensor | None = None, loss_fn: Callable | None = None,
             **kwargs) -> torch.Tensor:
        """The forward half of ``step``: the loss it trains on, with its graph, for a backward of your own."""
        raise InputError(f"{type(self).__name__} runs forward and backward together (a pipeline schedule "
                         "interleaves them over microbatches): use pm.step, or pp=1 for pm.loss")

    def average_gradients(self) -> None:
        """Average the gradients over the data-parallel replicas under ``dp_mode='replicate'``. Without pipelines
        every backward does it at its end, as DDP does (under fsdp, FSDP's hooks); calling it again changes nothing."""
        if self._dp is not None:
            self._dp.average_gradients(self.parameters())

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the gradients as ``torch.nn.utils.clip_grad_norm_`` clips the unsharded model's; returns the
        total norm, the same on every rank (collective: every rank must call it, after ``step``)."""
        self._adapters_on("clip_grad_norm_")
        pieces, seen = [], set()
        for module in self.rank_modules():
            for target, p in module.named_parameters():
                if p.grad is None or id(p) in seen:
                    continue
                seen.add(id(p))
                split = split_param(self.plan, self._names, target, self.tp_rank)
                dp_counts = self._dp.counts(p) if self._dp is not None else True
                counted = is_counted(split, self.tp_rank, dp_counts, self._is_first_holder(target))
                if self._dp is not None and id(p) in self._dp.experts:  # ep above tp: each expert's first holder
                    counted = self.dp_rank * self.plan.tp + self.tp_rank < self.options.ep
                pieces.append((local(p.grad), counted))
        return clip_grad_norm_(pieces, max_norm, norm_type, self._norm_group(), distributed=self.comm is not None)

    def manual_seed(self, seed: int) -> None:
        """Restart the random stream of dropout and every other random op at ``seed`` on this rank (call it with
        the same seed on every rank): without pipelines the masks are then those a single process draws after
        ``torch.manual_seed(seed)``."""
        self._stream.manual_seed(seed)

    def local_state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's tensors (tensor-parallel shards for split parameters, whole over data-parallel replicas)
        under the original names; collective over dp under fsdp."""
        self._adapters_on("reading the state")
        return {name: gathered(t) for module in self.rank_modules() for name, t in self._names.local(module).items()}

    def _holding(self) -> Holding:
        self._adapters_on("a checkpoint")
        own = {n: t for module in self.rank_modules() for n, t in self._names.local(module).items()}
        params = {n: p for module in self.rank_modules() for n, p in self._names.params(module).items()}
        group = self._checkpoint_group()
        # ep above tp: a rank's experts are its place in the expert-parallel group, not its tp rank
        experts = None
        if self.expert_comm is not None:
            experts = (expert_rank(self.dp_rank, self.tp_rank, self.plan.tp, self.options.ep), self.options.ep)
        return holding(self.plan, self.tp_rank, own, params, self._names.extra_state, self._names.aliases, group,
                       self.comm is not None, self._names.shapes, experts)

    def _checkpoint_group(self):
        """The group a checkpoint's collectives span (None: the whole world)."""
        return None

    def full_state_dict(self) -> dict[str, object]:
        """Full tensors under the original model's state-dict keys, on every rank.

        A collective call: every rank must make it (a rank calling it alone fails once the group's timeout
        passes, with ``RankFailure``).
        """
        mine = {name: self._gathered(name, t) for name, t in self.local_state_dict().items()}
        return self._names.complete(self._collect_stages(mine))

    def _gathered(self, name: str, local: torch.Tensor) -> torch.Tensor:
        """The full tensor of ``name``: a bank split among ep ranks above tp gathered over its ep group (its experts
        held in ep-rank order), any other over tp."""
        placement = self.plan.placements.get(name)
        if self.expert_comm is not None and placement is not None and placement.kind is PlacementKind.EXPERT:
            return torch.cat(self.expert_comm.all_gather(local.detach()))
        return gather_tp(self.plan, name, local, self.comm, self._names.shapes.get(name))

    def close(self) -> None:
        """Release the process groups this module holds (done at exit); it cannot communicate afterwards."""
        meshes = {id(m): m for m in (getattr(p, "device_mesh", None) for p in self.parameters()) if m is not None}
        for mesh in meshes.values():  # the DTensor parameters' meshes hold their groups too
            release_groups(mesh)
        if self.comm is not None and hasattr(self.comm, "close"):
            self.comm.close()
        if self._dp is not None:
            self._dp.mesh.close()
