"""How a rank's tensors map back to the original model: state-dict names, which chunks count as a rank's own,
and the full tensor of a parameter gathered from the tensor-parallel ranks."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from autotp.capture import Captured
from autotp.passes.placement import Part, Source, Want, full_tensor, own_tensors, part_of
from autotp.planning.plan import Plan
from autotp.rewrite.comm import Communicator, all_gather_chunks


@dataclass
class StateNames:
    """How a rank's module names map back to the original model's state dict."""

    state_keys: tuple[str, ...]
    """Keys of the original ``model.state_dict()``, in order."""
    aliases: dict[str, str]
    """Every name -> the name its (possibly tied) tensor is kept under."""
    param_name: Callable[[str], str]
    """Attribute target in a rank module -> original name."""
    extra_state: dict[str, object]
    """State the graph never reads (unused buffers, ``None`` or other extra state), kept so full_state_dict
    has every key."""
    shapes: dict[str, tuple[int, ...]]
    """Kept name -> the full tensor's shape, which a rank's shard does not tell where the chunks differ (a
    vocabulary tp does not divide)."""

    def local(self, module: nn.Module) -> dict[str, torch.Tensor]:
        """A rank module's tensors (shards for split parameters) under the original names."""
        return {self.param_name(k): v for k, v in module.state_dict().items() if not k.startswith("autotp_")}

    def params(self, module: nn.Module) -> dict[str, nn.Parameter]:
        """A rank module's parameters under the original names."""
        return {self.param_name(k): p for k, p in module.named_parameters()}

    def complete(self, full: dict[str, torch.Tensor]) -> dict[str, object]:
        """Every original key, from full tensors keyed by kept names."""
        full = full | {k: _copy(v) for k, v in self.extra_state.items()}
        return {k: full[self.aliases.get(k, k)] for k in self.state_keys}


def _copy(value):
    return value.detach().clone() if isinstance(value, torch.Tensor) else value


def state_names(model: nn.Module, captured: Captured, modules, source: Source | None = None) -> StateNames:
    """The state-dict bookkeeping for rank modules built from ``captured``; ``source`` gives the values of state
    the graph never reads (default: the model's own)."""
    kept = {captured.param_name(k) for m in modules for k in m.state_dict()}
    # Every rank keeps a copy of state the graph never reads, so full_state_dict has every key.
    extra = {k: _copy(v) for k, v in model.state_dict().items() if captured.aliases.get(k, k) not in kept}
    tensors = [k for k, v in extra.items() if isinstance(v, torch.Tensor)]
    wants = [Want(captured.aliases.get(k, k), extra[k], Part(tuple(extra[k].shape))) for k in tensors]
    extra |= dict(zip(tensors, (source or own_tensors)(wants)))
    shapes = {captured.aliases.get(k, k): tuple(v.shape) for k, v in model.state_dict(keep_vars=True).items()
              if isinstance(v, torch.Tensor)}
    return StateNames(captured.state_keys, captured.aliases, captured.param_name, extra, shapes)


def split_param(plan: Plan, names: StateNames, target: str, tp_rank: int = 0) -> bool:
    """Whether the parameter a rank module holds at ``target`` is split over the tensor-parallel ranks and this
    rank's chunk is its own (of a chunk several ranks hold, only the first holder's counts as its own)."""
    name = names.param_name(target)
    placement = plan.placements.get(names.aliases.get(name, name))
    return placement is not None and placement.is_split and plan.tp > 1 and tp_rank % placement.replicas == 0


def gather_tp(plan: Plan, name: str, local: torch.Tensor, comm: Communicator | None,
              shape: tuple[int, ...] | None = None) -> torch.Tensor:
    """The full tensor of parameter ``name`` (of ``shape``; None: cut in equal chunks) from every
    tensor-parallel rank's shard (collective)."""
    placement = plan.placements.get(name)
    if placement is None or not placement.is_split or plan.tp == 1:
        return local.detach().clone()
    if shape is None:
        return full_tensor(placement, comm.all_gather(local.detach()))
    lengths = [part_of(placement, shape, r, plan.tp).local_shape[placement.dim] for r in range(plan.tp)]
    return full_tensor(placement, all_gather_chunks(comm, local.detach(), placement.dim, lengths))
