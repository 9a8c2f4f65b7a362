"""The split parts of adapters averaged over the replicas in the end-of-backward bucket's one all-reduce.

Under ``dp_mode="replicate"`` the gradient bucket (``rewrite.grad_bucket``) sums the adapters' whole matrices over
the tp x dp ranks and divides by dp. The adapters' split parts (``B`` on a column-split layer, ``A`` on a row-split
one) need only the dp average, which was a second all-reduce per step. They ride in the bucket instead: each tp
rank writes its parts into its own slot of a zero-padded region of the bucket's buffer, so the same all-reduce over
tp x dp (divided by dp) leaves in slot ``j`` the dp mean of tp rank ``j``'s parts (the other tp ranks add zeros to
it). The buffer grows by (tp - 1) slots: it is done only when the padded region fits in one DDP-sized bucket
(adapters are small); a larger remainder (a ``modules_to_save`` LM head) keeps the replicas' own average.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from torch.distributed.tensor import DTensor


def rider_params(modules: Iterable[nn.Module], skip: set[int]) -> list[nn.Parameter]:
    """The trainable parameters of ``modules`` not in ``skip``, each once, in the modules' order (the same on every
    rank of a stage: the ranks' graphs have one structure)."""
    seen, out = set(skip), []
    for module in modules:
        for _, p in module.named_parameters():
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                out.append(p)
    return out


def slot_numel(comm, numel: int, tp_rank: int, tp: int, dp: int) -> int:
    """The largest number of rider elements any tp rank holds (its slot's size, the same on every rank): one
    all-reduce of a tp-long vector over ``comm`` (tp x dp ranks), made once when the module is built."""
    sizes = torch.zeros(tp, dtype=torch.float64)
    sizes[tp_rank] = numel
    sizes = comm.all_reduce(sizes) / dp
    return int(sizes.max().round().item())


def pack(riders: list[nn.Parameter], grads: list[torch.Tensor | None], slot: int, tp_rank: int, tp: int,
         dtype: torch.dtype) -> torch.Tensor:
    """The padded region: ``tp`` slots of ``slot`` elements, this rank's riders' gradients in slot ``tp_rank``
    (zeros for one without a gradient), zeros elsewhere."""
    region = torch.zeros(tp * slot, dtype=dtype, device=riders[0].device if riders else None)
    at = tp_rank * slot
    for n, g in zip(local_sizes(riders), grads):
        if g is not None:
            region[at:at + n] = g.reshape(-1)
        at += n
    return region


def unpack(region: torch.Tensor, riders: list[nn.Parameter], grads: list[torch.Tensor | None], slot: int,
           tp_rank: int) -> None:
    """Copy this rank's slot of the reduced ``region`` back into ``grads`` (local gradient tensors, in place)."""
    at = tp_rank * slot
    for n, g in zip(local_sizes(riders), grads):
        if g is not None:
            g.copy_(region[at:at + n].view_as(g))
        at += n


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's piece of ``tensor`` (a DTensor's local shard, sharing its storage), else itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def local_sizes(riders: list[nn.Parameter]) -> list[int]:
    """Each rider's number of elements on this rank (a DTensor's local shard)."""
    return [local(p).numel() for p in riders]
