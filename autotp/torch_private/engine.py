"""Private torch reads the runtime makes on a running parallel module: the autograd engine's end-of-backward
callback, a DeviceMesh's process-group references, DDP's running module."""

from __future__ import annotations

import sys

import torch

from autotp.torch_private.entries import FIRST_RELEASE, fenced
from autotp.torch_private.graph_facts import changed


@fenced("Variable._execution_engine.queue_callback, the autograd engine's end-of-backward callback", FIRST_RELEASE)
def at_backward_end(callback) -> None:
    """Run ``callback`` once the running backward pass has finished (called from within it: a gradient hook),
    as DDP and FSDP do to reduce gradients after their accumulation."""
    engine = getattr(torch.autograd.Variable, "_execution_engine", None)
    queue = getattr(engine, "queue_callback", None)
    if queue is None:
        raise changed("how a callback is queued at the end of a backward", "Variable._execution_engine.queue_callback")
    queue(callback)


@fenced("Tensor._base, the tensor a view was made of", FIRST_RELEASE)
def viewed_leaf(tensor: torch.Tensor) -> torch.Tensor:
    """The leaf tensor ``tensor`` is a view of, through views of views (a module's full backward hook hands its
    forward a view of each input: ``nn.modules._functions.BackwardHookFunction``), or ``tensor`` itself."""
    while not tensor.is_leaf and getattr(tensor, "_base", None) is not None:
        tensor = tensor._base
    return tensor


@fenced("DeviceMesh._pg_registry and _root_mesh; a release without them keeps the groups", FIRST_RELEASE)
def release_groups(mesh) -> None:
    """Drop the references a DeviceMesh (and its root) keeps to its process groups, so that a closed module's
    groups are freed while Python runs (a gloo group freed at interpreter exit aborts the process)."""
    for owner in (mesh, getattr(mesh, "_root_mesh", None)):
        registry = getattr(owner, "_pg_registry", None)
        if isinstance(registry, dict):
            registry.clear()


@fenced("DistributedDataParallel._active_ddp_module, which DDP sets around its wrapped module's call",
        FIRST_RELEASE)
def active_ddp_module():
    """The DistributedDataParallel module whose forward is running (calling this one), or None; a release without
    the attribute raises ``InternalError`` here, rather than a DDP wrap going unnoticed."""
    from torch.nn.parallel import DistributedDataParallel

    if not hasattr(DistributedDataParallel, "_active_ddp_module"):
        raise changed("how DistributedDataParallel marks its running forward",
                      "DistributedDataParallel._active_ddp_module")
    return DistributedDataParallel._active_ddp_module


@fenced("torch.distributed.tensor._redistribute's planner caches and debug._clear_sharding_prop_cache; a release "
        "without one skips it", FIRST_RELEASE)
def forget_dtensor_meshes() -> None:
    """Empty torch's DTensor caches, which hold every mesh FSDP sharded over (its redistribution planners, its
    sharding propagation's specs) and so the mesh's process groups, past ``destroy_process_group`` and past the
    parallel module itself (measured: tp=1 x dp=2 left three groups' gloo threads running into shutdown, where
    one aborts the process as ``free_default_group_on_destroy`` says)."""
    if "torch.distributed.tensor" not in sys.modules:
        return
    from torch.distributed.tensor import _redistribute, debug

    for clear in (getattr(_redistribute, "clear_redistribute_planner_cache", None),
                  getattr(getattr(_redistribute, "_gen_transform_infos", None), "cache_clear", None),
                  getattr(debug, "_clear_sharding_prop_cache", None)):
        if clear is not None:
            clear()


@fenced("DTensor._local_tensor and DTensor._spec; a release without them takes the public from_local/to_local", FIRST_RELEASE)
def local_and_spec(param):
    """A DTensor's local tensor (itself, not a view) and its spec, or None where the release lacks either: what a
    parameter's local read needs to hand its gradient back without rebuilding the spec each backward."""
    local, spec = getattr(param, "_local_tensor", None), getattr(param, "_spec", None)
    return None if local is None or getattr(spec, "tensor_meta", None) is None else (local, spec)


@fenced("DTensor(local, spec, requires_grad=), the constructor DTensor.from_local ends in", FIRST_RELEASE)
def dtensor_of(local, spec):
    """A DTensor (no autograd history) whose local tensor is ``local`` and spec a copy of ``spec``: what
    ``DTensor.from_local`` builds, without its autograd node and its spec's recomputation. ``local`` must have the
    dtype and strides ``spec`` was made for (the parameter's own). The spec is copied, as torch's own ``to_local``
    backward does, so that no two DTensors share one."""
    import copy

    from torch.distributed.tensor import DTensor

    return DTensor(local, copy.copy(spec), requires_grad=False)
