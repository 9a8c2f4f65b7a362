"""Run a benchmark body on N real ranks (spawned processes: gloo on CPU, NCCL on GPU) and collect results.

Like ``tests/distributed.py``, but the backend, the device and the threads per rank are chosen by the
benchmark, and one spawn runs every multi-process section so process start-up is paid once.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import signal
import socket
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from autotp.runtime.process import free_default_group_on_destroy


def free_port() -> int:
    """A TCP port free on this host now (for a group's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def backend_for(device: str) -> str:
    """NCCL for GPUs, gloo for CPUs."""
    return "nccl" if device == "cuda" else "gloo"


def _entry(rank: int, world: int, port: int, device: str, threads: list[int], fn: Callable, args: tuple,
           out: str, limit_s: float | None) -> None:
    if limit_s:  # a hung rank prints where every one of its threads is, then exits: its peers are stopped with it
        faulthandler.dump_traceback_later(limit_s, exit=True)
    # LOCAL_RANK is how autotp (and torchrun users) pick this rank's GPU under NCCL.
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_RANK=str(rank))
    # Set once, before any work: changing it later stalls OpenMP for up to seconds (measured).
    if threads[rank] > 0:  # 0: leave torch's default (GPU ranks)
        torch.set_num_threads(threads[rank])
    if device == "cuda":
        torch.cuda.set_device(rank)
    free_default_group_on_destroy()  # else destroy_process_group may leave gloo's threads to interpreter shutdown
    dist.init_process_group(backend_for(device), rank=rank, world_size=world)
    try:
        result = fn(rank, world, *args)
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
            json.dump(result, f)
        _meet_before_teardown(device)
    finally:
        if dist.is_initialized():  # a rank left out by ``reform_world`` has no group any more
            dist.destroy_process_group()  # gloo's threads joined here, while Python can still run their clean-up


TEARDOWN_WAIT = timedelta(seconds=60)
"""How long a rank that finished waits for its peers before tearing its group down."""


def _meet_before_teardown(device: str) -> None:
    """Wait, bounded, until every rank finished, so that no rank tears its group down while a peer may still talk
    to it. A peer that already left its group (a test of a stopped rank does so on purpose) cannot meet: its result
    is written, so that is not a failure of the run."""
    if not dist.is_initialized():
        return
    try:
        if backend_for(device) == "gloo":
            dist.monitored_barrier(timeout=TEARDOWN_WAIT)
        else:
            dist.barrier()
    except (RuntimeError, dist.DistError):
        pass


def reform_world(size: int, device: str) -> bool:
    """Make the first ``size`` ranks the default process group (collective over the current one).

    autotp's pipelines lay ranks out on the whole default group (world size == tp x pp), so a section
    needing fewer ranks than were spawned re-forms it rather than paying for another spawn. Every
    other group is destroyed with the old default one. Returns whether this rank is in the new group.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    if size > world:
        raise ValueError(f"cannot form a group of {size} ranks from {world}")
    if size == world:
        return True
    port = [free_port() if rank == 0 else None]
    dist.broadcast_object_list(port, src=0)
    dist.destroy_process_group()
    if rank >= size:
        return False
    os.environ["MASTER_PORT"] = str(port[0])
    dist.init_process_group(backend_for(device), rank=rank, world_size=size)
    return True


@contextlib.contextmanager
def _passive_openmp():
    """OMP_WAIT_POLICY=PASSIVE for the processes spawned inside (unless the user set a policy).

    libgomp's default, spinning, made 2-thread steps erratic on a 2-vCPU VM (median 251 ms, max 1.8 s,
    against 245 ms on one thread); passive waiting gave 152 ms with a tight spread. A 1-thread process
    has no OpenMP pool, so the tp ranks are unaffected. It must be set before libgomp loads: at spawn.
    """
    if "OMP_WAIT_POLICY" in os.environ:
        yield
        return
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    try:
        yield
    finally:
        del os.environ["OMP_WAIT_POLICY"]


def stop_ranks(processes) -> None:
    """Kill the ranks still running, and reap them: a rank left behind by an interrupted caller would hold its
    cores (and the port) while every later test ran beside it."""
    for process in processes:
        if process.is_alive():
            process.kill()
    for process in processes:
        process.join(5)


FORK_PROBE_LIMIT_S = 30
"""How long the probe child of ``fork_runs_backward`` may take (it runs one tiny backward) before it counts as hung."""
_FORK_BROKEN = [False]
"""Set once a probe failed: autograd's device threads, once started, stay for the life of the process."""


def fork_runs_backward() -> bool:
    """Whether a process forked from this one now can run a backward, found by forking one that tries.

    torch refuses a backward in a forked child ("Unable to handle autograd's threading in combination with
    fork-based multiprocessing") once the parent's autograd engine started its per-device threads. On a CPU build
    of torch 2.13 it never does; on CUDA builds (2.14.1's, even with no GPU) a backward after any fake-tensor trace
    (every capture) does. Asking a child is exact on any build and needs no private torch state."""
    if _FORK_BROKEN[0]:
        return False
    pid = os.fork()
    if pid == 0:  # the child: exit without running the parent's atexit handlers or flushing its buffers
        code = 1
        try:
            x = torch.ones(2, requires_grad=True)
            (x * x).sum().backward()
            code = 0
        finally:
            os._exit(code)
    deadline = time.monotonic() + FORK_PROBE_LIMIT_S
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            _FORK_BROKEN[0] = os.waitstatus_to_exitcode(status) != 0
            return not _FORK_BROKEN[0]
        time.sleep(0.005)
    os.kill(pid, signal.SIGKILL)  # hung: a fork is not safe here either
    os.waitpid(pid, 0)
    return False


def start_method_for(start_method: str) -> str:
    """``start_method``, except "fork" where a forked rank could not run a backward (``fork_runs_backward``):
    "spawn" then, whose fresh interpreters pay their imports and captures again but run."""
    if start_method == "fork" and not fork_runs_backward():
        return "spawn"
    return start_method


def run_on_ranks(fn: Callable, device: str, threads: list[int], *args, start_method: str = "spawn",
                 limit_s: float | None = None) -> list:
    """``fn(rank, world, *args)`` on ``len(threads)`` ranks; returns each rank's (JSON-able) result, in rank order.

    ``threads[r]`` is rank r's torch intra-op thread count: with tp ranks on a machine with tp cores,
    1 keeps every rank on its own core. ``start_method`` "fork" starts the ranks as copies of this process (CPU
    only: what it holds, the tests' captures, comes with them; threads this process ran must be
    gone, ``autotp.rewrite.comm.join_fully``), or fresh interpreters where forked ranks could not run a backward
    (``start_method_for``); "spawn" starts fresh interpreters. A rank still running after
    ``limit_s`` seconds writes every thread's stack to stderr and exits, which fails the run naming it.
    """
    world = len(threads)
    if device == "cuda" and torch.cuda.device_count() < world:
        raise RuntimeError(f"--device cuda needs {world} GPUs, found {torch.cuda.device_count()}")
    with tempfile.TemporaryDirectory() as out, _passive_openmp():
        context = mp.start_processes(_entry, args=(world, free_port(), device, threads, fn, args, out, limit_s),
                                     nprocs=world, join=False, start_method=start_method_for(start_method))
        try:
            while not context.join():
                pass
        finally:  # a caller's time limit (pytest-timeout) or Ctrl-C interrupts the join: stop the ranks with it
            stop_ranks(context.processes)
        results = []
        for rank in range(world):
            with open(os.path.join(out, f"rank{rank}.json")) as f:
                results.append(json.load(f))
    return results
