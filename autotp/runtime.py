"""The runtime: process groups, the plan check across ranks, and the module a user trains.

``parallelize`` works under torchrun (it initialises the default group from the environment) or
with a group the caller already made; gloo on CPU, NCCL on GPU.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import fx, nn

from autotp.errors import RuntimeSetupError
from autotp.plan import Plan
from autotp.shards import assemble, segments_or_whole


def ensure_process_group(world_needed: int):
    """The default process group, initialised from torchrun's environment if needed.

    Returns None when a single process suffices and none exists.
    """
    if dist.is_available() and dist.is_initialized():
        return dist.group.WORLD
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend)
        return dist.group.WORLD
    if world_needed == 1:
        return None
    raise RuntimeSetupError(
        f"{world_needed} ranks (tp x pp) need {world_needed} processes, but no torch.distributed process group exists. "
        f"Launch with `torchrun --nproc-per-node {world_needed} your_script.py`, or call "
        "torch.distributed.init_process_group(...) before autotp.parallelize.")


def device_for(group) -> torch.device | None:
    """The GPU this rank's shards must live on under NCCL (LOCAL_RANK, as torchrun sets); None for gloo."""
    if group is None or dist.get_backend(group) != "nccl":
        return None
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", torch.cuda.current_device())))
    torch.cuda.set_device(device)
    return device


def check_world(group, tp: int, pp: int = 1) -> None:
    """The group must have exactly tp × pp ranks."""
    world = dist.get_world_size(group) if group is not None else 1
    if world != tp * pp:
        setting = f"tp={tp}" if pp == 1 else f"tp={tp} x pp={pp}"
        raise RuntimeSetupError(
            f"the process group has {world} ranks but {setting} needs {tp * pp}; autotp needs world size == tp x pp. "
            f"Launch {tp * pp} processes (torchrun --nproc-per-node {tp * pp}) or change the setting.")


def check_same_plan(plan: Plan, group) -> None:
    """Every rank must have computed the same plan; fail clearly if not."""
    if group is None:
        return
    mine = plan.fingerprint()
    everyone: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    if len(set(everyone)) != 1:
        listing = ", ".join(f"rank {r}: {h}" for r, h in enumerate(everyone))
        raise RuntimeSetupError(
            f"ranks computed different plans ({listing}). Give every rank the same model, example_inputs "
            "and settings (or load one saved plan on all ranks with plan=Plan.from_json(...)).")


def default_loss(output, target: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of the logits (``output.logits`` for Hugging Face outputs) against ``target``."""
    logits = getattr(output, "logits", output)
    if isinstance(logits, (tuple, list)):
        logits = logits[0]
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


@dataclass
class StateNames:
    """How a rank's module names map back to the original model's state dict."""

    state_keys: tuple[str, ...]
    """Keys of the original ``model.state_dict()``, in order."""
    aliases: dict[str, str]
    """Every name -> the name its (possibly tied) tensor is kept under."""
    param_name: Callable[[str], str]
    """Attribute target in a rank module -> original name."""
    extra_state: dict[str, torch.Tensor]
    """State the graph never reads (unused buffers), kept as copies so full_state_dict is complete."""

    def local(self, module: nn.Module) -> dict[str, torch.Tensor]:
        """A rank module's tensors (shards for split parameters) under the original names."""
        return {self.param_name(k): v for k, v in module.state_dict().items() if not k.startswith("autotp_")}

    def complete(self, full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Every original key, from full tensors keyed by kept names."""
        full = full | {k: v.clone() for k, v in self.extra_state.items()}
        return {k: full[self.aliases.get(k, k)] for k in self.state_keys}


def gather_tp(plan: Plan, name: str, local: torch.Tensor, group) -> torch.Tensor:
    """The full tensor of parameter ``name`` from every tensor-parallel rank's shard (collective)."""
    placement = plan.placements.get(name)
    if placement is None or not placement.is_split or plan.tp == 1:
        return local.detach().clone()
    parts = [torch.empty_like(local) for _ in range(plan.tp)]
    dist.all_gather(parts, local.detach().contiguous(), group=group)
    size = local.shape[placement.dim] * plan.tp
    return assemble(parts, placement.dim, segments_or_whole(placement.segments, size))


class ParallelModule(nn.Module):
    """This rank's piece of a tensor-parallel model; computes what the original model computes."""

    def __init__(self, module: fx.GraphModule, plan: Plan, group, rank: int, names: StateNames):
        super().__init__()
        self.module = module
        self.plan = plan
        self.group = group
        self.rank = rank
        self._names = names

    def forward(self, *inputs):
        """The original model's output, identical on every rank."""
        return self.module(*inputs)

    def step(self, *inputs, target: torch.Tensor, loss_fn: Callable | None = None) -> torch.Tensor:
        """Forward and backward on ``inputs``; returns the (detached) loss. Gradients land in ``parameters()``."""
        loss = (loss_fn or default_loss)(self.module(*inputs), target)
        loss.backward()
        return loss.detach()

    def local_state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's tensors (shards for split parameters) under the original names."""
        return self._names.local(self.module)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Full tensors under the original model's state-dict keys, on every rank (a collective call)."""
        full = {name: gather_tp(self.plan, name, t, self.group) for name, t in self.local_state_dict().items()}
        return self._names.complete(full)
