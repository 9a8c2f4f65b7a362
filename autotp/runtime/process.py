"""Process groups: the default group from torchrun's environment, checks across ranks, one source of truth.

``parallelize`` works under torchrun (it initialises the default group from the environment, with a
bounded timeout) or with a group the caller already made; gloo on CPU, NCCL on GPU. ``group=None``
means torch's default group throughout: autotp holds no reference to it, so ``destroy_process_group``
frees it (a reference kept past it left gloo's threads to be freed during interpreter shutdown, which
aborted; ``free_default_group_on_destroy`` keeps torch's own modules from keeping one). Modules that hold other
groups are closed at exit (``close_at_exit``).
"""

from __future__ import annotations

import atexit
import os
import weakref
from datetime import timedelta

import torch
import torch.distributed as dist

from autotp.errors import RuntimeSetupError
from autotp.passes.placement import Source, Want
from autotp.planning.plan import Plan

DEFAULT_TIMEOUT = timedelta(minutes=10)
"""How long a collective waits for the other ranks when autotp creates the group (torch's own default is
30 minutes): a rank that died or hangs stops the others within this bound."""


def free_default_group_on_destroy() -> None:
    """Import ``torch.distributed.nn.functional`` now if no process group exists yet (call it before
    ``init_process_group``; importing autotp does).

    Its functions take ``group=group.WORLD`` as a default argument, evaluated once, at import. Imported while a
    default group exists (``torch.distributed.fsdp`` imports it: transformers does when it builds a config, autotp
    for ``dp_mode="fsdp"``), they keep that group alive after ``destroy_process_group``: gloo's threads are then
    joined only during interpreter shutdown, where one that needs Python aborts the process with ``terminate
    called without an active exception`` (issue 23; measured: the group outlived ``destroy_process_group`` in every
    generation benchmark rank). Imported first, the defaults are None."""
    if dist.is_available() and not dist.is_initialized():
        import torch.distributed.nn.functional  # noqa: F401


free_default_group_on_destroy()


def ensure_process_group(world_needed: int, timeout: timedelta | float | None = None) -> bool:
    """Whether a process group exists, initialising the default one from torchrun's environment if needed.

    False when a single process suffices and none exists; ``timeout`` (seconds or a timedelta) bounds every
    collective of a group autotp creates.
    """
    if dist.is_available() and dist.is_initialized():
        return True
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        free_default_group_on_destroy()
        dist.init_process_group(backend, timeout=_timedelta(timeout))
        return True
    if world_needed == 1:
        return False
    raise RuntimeSetupError(
        f"{world_needed} ranks (tp x pp x dp) need {world_needed} processes, but no torch.distributed process group "
        "exists. "
        f"Launch with `torchrun --nproc-per-node {world_needed} your_script.py`, or call "
        "torch.distributed.init_process_group(...) before autotp.parallelize.")


def _timedelta(timeout) -> timedelta:
    if timeout is None:
        return DEFAULT_TIMEOUT
    return timeout if isinstance(timeout, timedelta) else timedelta(seconds=float(timeout))


def world_size(group, distributed: bool) -> int:
    """Ranks in ``group`` (None: the default group); 1 without a process group."""
    return dist.get_world_size(group) if distributed else 1


def device_for(group, distributed: bool) -> torch.device | None:
    """The GPU this rank's shards must live on under NCCL (LOCAL_RANK, as torchrun sets); None for gloo."""
    if not distributed or dist.get_backend(group) != "nccl":
        return None
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", torch.cuda.current_device())))
    torch.cuda.set_device(device)
    return device


def first_rank(group, distributed: bool) -> bool:
    """Whether this process is the group's first rank (the one that prints); True without a group."""
    return not distributed or dist.get_rank(group) == 0


def check_world(group, distributed: bool, tp: int, pp: int = 1, dp: int = 1) -> None:
    """The group must have exactly tp × pp × dp ranks."""
    world, needed = world_size(group, distributed), tp * pp * dp
    if world != needed:
        used = [(axis, n) for axis, n in (("tp", tp), ("pp", pp), ("dp", dp)) if n > 1 or axis == "tp"]
        setting, product = " x ".join(f"{a}={n}" for a, n in used), " x ".join(a for a, _ in used)
        raise RuntimeSetupError(
            f"the process group has {world} ranks but {setting} needs {needed}; autotp needs world size == {product}. "
            f"Launch {needed} processes (torchrun --nproc-per-node {needed}) or change the setting.")


def check_same_plan(plan: Plan, group, distributed: bool) -> None:
    """Every rank must have computed the same plan; fail clearly if not."""
    if not distributed:
        return
    mine = plan.fingerprint()
    everyone: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    if len(set(everyone)) != 1:
        listing = ", ".join(f"rank {r}: {h}" for r, h in enumerate(everyone))
        raise RuntimeSetupError(
            f"ranks computed different plans ({listing}). Give every rank the same model, example_inputs "
            "and settings (or load one saved plan on all ranks with plan=Plan.from_json(...)).")


def shared_seed(group, distributed: bool) -> int:
    """The seed every rank's random stream starts from: the first rank's ``torch.initial_seed()``."""
    seed = [torch.initial_seed()]
    if distributed:
        dist.broadcast_object_list(seed, group=group, group_src=0)
    return int(seed[0])


def from_first_rank(model: torch.nn.Module, group, distributed: bool) -> Source | None:
    """A tensor source that gives every rank its part of the first rank's copy of the model's state (as torch's
    ``src_data_rank=0``), so ranks whose models were initialised differently still hold slices of one model.

    Every rank broadcasts the whole state in the same order first (a rank that holds only some pipeline
    stages still takes part in every broadcast); None without a group.
    """
    if not distributed:
        return None
    synced: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, tensor in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        if id(tensor) in seen or not _broadcastable(tensor):
            continue
        seen.add(id(tensor))
        copy = tensor.detach().clone()
        dist.broadcast(copy, group=group, group_src=0)
        synced[name] = copy

    def source(wants: list[Want]) -> list[torch.Tensor]:
        return [w.part.take(synced.get(w.name, w.tensor.detach())) for w in wants]

    return source


def _broadcastable(tensor: torch.Tensor) -> bool:
    """Whether gloo and NCCL can broadcast this dtype (bool masks are recomputed alike on every rank anyway)."""
    return tensor.is_floating_point() or tensor.is_complex() or tensor.dtype in (torch.int64, torch.int32)


_OPEN: weakref.WeakSet = weakref.WeakSet()


def close_at_exit(module) -> None:
    """Call ``module.close()`` when the interpreter exits, before it starts finalising: the process groups
    it holds are then freed while Python can still run their threads' clean-up."""
    _OPEN.add(module)


@atexit.register
def _close_all() -> None:
    for module in list(_OPEN):
        module.close()
