"""Process groups: the default group from torchrun's environment, world-size and plan checks across ranks.

``parallelize`` works under torchrun (it initialises the default group from the environment) or
with a group the caller already made; gloo on CPU, NCCL on GPU.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from autotp.errors import RuntimeSetupError
from autotp.planning.plan import Plan


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
