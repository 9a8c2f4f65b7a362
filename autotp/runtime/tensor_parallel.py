"""The tensor-parallel runtime: the module a user trains, and how its state maps back to the original.

``ParallelModule`` runs one rank's rewritten graph; ``full_state_dict`` gathers the shards back into
tensors under the original model's state-dict keys.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import fx, nn

from autotp.capture import Captured
from autotp.planning.plan import Plan
from autotp.rewrite.shards import assemble, segments_or_whole


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


def state_names(model: nn.Module, captured: Captured, modules) -> StateNames:
    """The state-dict bookkeeping for rank modules built from ``captured``."""
    kept = {captured.param_name(k) for m in modules for k in m.state_dict()}
    # Every rank keeps a copy of state the graph never reads, so full_state_dict has every key.
    extra = {k: v.detach().clone() for k, v in model.state_dict().items() if captured.aliases.get(k, k) not in kept}
    return StateNames(captured.state_keys, captured.aliases, captured.param_name, extra)


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
