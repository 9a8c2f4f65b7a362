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
import gc
import inspect
import os
import sys
import weakref
from datetime import timedelta

import torch
import torch.distributed as dist

from autotp.errors import RuntimeSetupError
from autotp.passes.placement import Source, Want
from autotp.planning.plan import Plan
from autotp.torch_private import forget_dtensor_meshes

DEFAULT_TIMEOUT = timedelta(minutes=10)
"""How long a collective waits for the other ranks when autotp creates the group (torch's own default is
30 minutes): a rank that died or hangs stops the others within this bound."""


_HOLD_THE_GROUP_THEY_IMPORT_WITH = ("torch.distributed.nn.functional",
                                    "torch.distributed.optim.zero_redundancy_optimizer",
                                    "torch.distributed.fsdp.sharded_grad_scaler")
"""torch's modules whose functions default to ``group=group.WORLD``, a default evaluated once, at import."""


def free_default_group_on_destroy() -> None:
    """Keep torch's own modules from holding the default process group past ``destroy_process_group``.

    The functions of ``_HOLD_THE_GROUP_THEY_IMPORT_WITH`` take ``group=group.WORLD`` as a default argument.
    Imported while a default group exists (``torch.distributed.fsdp`` imports ``torch.distributed.nn``:
    transformers does when it builds a config, autotp when ``parallelize`` is first called after the user made
    the group), they keep that group alive after ``destroy_process_group``. Gloo's threads then outlive it, and the
    last collective's work, freed by one of them after the interpreter began to shut down, needs Python and
    aborts the process: ``terminate called without an active exception`` (issue 23; caught again under load in
    ``examples/tp_demo.py``, one run in four). Imported first, the defaults are None; imported late, they are set
    back to None here, which torch reads as the default group at call time, as ``group.WORLD`` would be."""
    if not dist.is_available():
        return
    import torch.distributed.nn.functional  # noqa: F401
    for name in _HOLD_THE_GROUP_THEY_IMPORT_WITH:
        module = sys.modules.get(name)
        for function in _functions_of(module) if module is not None else ():
            _default_groups_to_none(function)


def _functions_of(module) -> list:
    """The module's functions and the methods of the classes it defines."""
    out = []
    for value in vars(module).values():
        if inspect.isfunction(value):
            out.append(value)
        elif inspect.isclass(value) and value.__module__ == module.__name__:
            out += [f for f in vars(value).values() if inspect.isfunction(f)]
    return out


def _default_groups_to_none(function) -> None:
    def none_for_groups(value):
        return None if isinstance(value, dist.ProcessGroup) else value

    if function.__defaults__:
        function.__defaults__ = tuple(none_for_groups(v) for v in function.__defaults__)
    if function.__kwdefaults__:
        function.__kwdefaults__ = {k: none_for_groups(v) for k, v in function.__kwdefaults__.items()}


free_default_group_on_destroy()


def ensure_process_group(world_needed: int, timeout: timedelta | float | None = None) -> bool:
    """Whether a process group exists, initialising the default one from torchrun's environment if needed.

    False when a single process suffices and none exists; ``timeout`` (seconds or a timedelta) bounds every
    collective of a group autotp creates.
    """
    free_default_group_on_destroy()  # again: the caller's group may have been made before torch's modules loaded
    if dist.is_available() and dist.is_initialized():
        return True
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
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


def check_world(group, distributed: bool, tp: int, pp: int = 1, dp: int = 1, cp: int = 1) -> None:
    """The group must have exactly tp × pp × dp × cp ranks."""
    world, needed = world_size(group, distributed), tp * pp * dp * cp
    if world != needed:
        used = [(axis, n) for axis, n in (("tp", tp), ("pp", pp), ("dp", dp), ("cp", cp)) if n > 1 or axis == "tp"]
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
    forget_dtensor_meshes()
    gc.collect()  # a parallel module freed in a reference cycle holds its groups until a collection


