"""Collectives between the ranks of one host through shared memory: what generation's decode steps talk over.

A decode step at batch 1 makes two collectives per layer of a few KB each, and nothing else to overlap them with.
Over gloo each costs a loopback TCP round trip through gloo's I/O thread and a blocked thread's wake-up; on the
2-vCPU machine of docs/BENCHMARKS.md that measured 0.4 ms back to back and 1-3 ms after a few hundred
microseconds of compute (a halted vCPU is woken by the hypervisor), more than a layer's compute. Ranks on one
host instead write their values into a shared file (``/dev/shm``) and poll each other's counters, as DeepSpeed's
and vLLM's CPU inference do for their tensor-parallel all-reduce.

Waiting: a rank polls for a while (a balanced peer arrives within it, with no system call), then blocks on
its own named pipe, into which every rank writes a byte after each of its counter updates, so a waiting rank is
woken by its peers' writes, like a futex, and gives its core away meanwhile (polling with sleeps measured 4x slower
than gloo on a loaded machine: the woken poller and the late peer competed for the cores). How long it polls
depends on the host: with a core per process (``spin_seconds``), up to
``SPIN_SECONDS``, which covers the skew between the ranks' compute (a decode step's layers differ by a few hundred
microseconds between ranks, and a wake-up through the pipe costs as much again); with fewer cores than processes,
``SHORT_SPIN_SECONDS`` (a polling rank would hold the core its late peer needs). Within that, each wait that had to
block halves the next one's polling (``adapted_polling``): on a host that became busy, a polling rank spends the
scheduler credit that lets a woken one run at once.

Layout: one counter per rank (a cache line each), then two banks of one slot per rank. Collective ``n`` uses bank
``n % 2``: a rank writes its value into its slot, then its counter to ``n``, and waits for every counter to reach
``n``; a rank can only start collective ``n + 2`` (the same bank) after every rank wrote ``n + 1``, i.e. after
every rank finished reading ``n``. A value larger than a slot goes through in slot-sized pieces. Every rank sums the
slots in rank order, so all ranks hold the same bits. The slots are written before the counter and read after it,
which x86's store order guarantees (checked: other machines keep gloo).
"""

from __future__ import annotations

import mmap
import os
import platform
import select
import shutil
import socket
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from autotp.errors import RankFailure
from autotp.rewrite.comm import Communicator, TorchComm, settle
from autotp.runtime.peers import group_timeout

SLOT_BYTES = 1 << 20
"""Bytes each rank writes per step of a collective; larger values go through in pieces."""
_LINE = 64  # one counter per cache line: ranks polling their peers never contend for one line
SPIN_SECONDS = 2e-3
"""How long a waiting rank polls before it blocks on its pipe, with a core per process (measured on the 2-core
machine, batch 1 decode: 1.29x one process against 1.24x with ``SHORT_SPIN_SECONDS``)."""
SHORT_SPIN_SECONDS = 1e-4
"""How long it polls on a host with fewer cores than processes."""
_KEPT_VIEWS = 64
"""Slot views kept per communicator (by bank, dtype and shape); a prefill's shapes vary with the prompt."""


def spin_seconds(processes: int) -> float:
    """The most a rank polls before blocking, with ``processes`` processes of this job on this host: long only
    where they have a core each (other work on the host shortens each wait's polling as it comes:
    ``adapted_polling``; a load average lags it by a minute)."""
    return SPIN_SECONDS if len(os.sched_getaffinity(0)) >= processes else SHORT_SPIN_SECONDS


def adapted_polling(polling: float, blocked: bool, most: float) -> float:
    """The next wait's polling time: halved after a wait that had to block (a peer later than polling covers:
    the host is busy, and a polling rank burns the scheduler credit a woken one would get), regrown by a tenth
    after one that did not, within ``[SHORT_SPIN_SECONDS, most]``."""
    if blocked:
        return max(min(SHORT_SPIN_SECONDS, most), polling / 2)
    return min(most, polling * 1.1)


class SharedMemoryComm:
    """A ``Communicator`` over shared memory for ranks on one host (made by ``same_host``)."""

    def __init__(self, rank: int, size: int, folder: str, timeout: float, spin: float = SHORT_SPIN_SECONDS):
        self.rank, self.size, self.timeout, self.folder, self.spin = rank, size, timeout, folder, spin
        self.polling = spin
        """How long the next wait polls: ``spin`` at most, shorter while peers keep coming later than that."""
        self.closed = False
        self.count = 0
        self.pending: Callable[[], None] | None = None
        with open(os.path.join(folder, "memory"), "r+b") as f:
            self._map = mmap.mmap(f.fileno(), _file_bytes(size))
        self._counters = np.frombuffer(self._map, dtype=np.int64, count=size * _LINE // 8)[::_LINE // 8]
        self._slots = torch.frombuffer(self._map, dtype=torch.uint8, offset=size * _LINE).view(2, size, SLOT_BYTES)
        self._wake = os.open(_pipe(folder, rank), os.O_RDONLY | os.O_NONBLOCK)
        self._peers: list[tuple[int, int]] = []
        """(rank, write end of its pipe) of every peer."""
        self._views: dict = {}

    def connect(self) -> None:
        """Open the peers' pipes for writing (once every rank has opened its own for reading)."""
        self._peers = [(r, os.open(_pipe(self.folder, r), os.O_WRONLY | os.O_NONBLOCK)) for r in range(self.size)
                       if r != self.rank]

    def _exchange(self, data: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``data`` (flat bytes, at most ``SLOT_BYTES``), as views of the shared slots: read them before
        this rank's next collective."""
        bank = self._slots[(self.count + 1) % 2]
        bank[self.rank, :data.numel()].copy_(data)
        self._arrive()
        return [bank[r, :data.numel()] for r in range(self.size)]

    def _slot_views(self, x: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's slot of the next collective, as views of ``x``'s dtype and shape (kept: a decode step makes
        the same few collectives every token, and building views is most of a small one's cost); None for a value
        larger than a slot."""
        key = ((self.count + 1) % 2, x.dtype, x.shape)
        views = self._views.get(key)
        if views is None:
            nbytes = x.numel() * x.element_size()
            if nbytes > SLOT_BYTES:
                return None
            if len(self._views) >= _KEPT_VIEWS:
                self._views.clear()
            views = self._views[key] = [self._slots[key[0], r, :nbytes].view(x.dtype).view(x.shape)
                                        for r in range(self.size)]
        return views

    def _arrive(self) -> None:
        """Announce this rank's value of the next collective (written into its slot) and wait for every peer's."""
        self.count += 1
        self._counters[self.rank] = self.count  # after the slot: a peer that sees the count sees the value
        for peer, fd in self._peers:
            try:
                os.write(fd, b"\0")
            except BlockingIOError:  # a full pipe already holds wake-ups for a peer that never had to block
                pass
            except OSError as e:
                # A peer that already wrote this collective's value may have read ours (written before this wake-up)
                # and closed its pipe or exited since: this collective still completes.
                if self._counters[peer] < self.count:
                    raise RankFailure(f"rank {self.rank}: a peer of a collective over shared memory closed its end "
                                      f"({e}): another rank stopped (look for its own error above)") from e
        self._wait(self.count)

    def _wait(self, count: int) -> None:
        start = time.perf_counter()
        blocked = False
        while (self._counters < count).any():
            waited = time.perf_counter() - start
            if waited < self.polling:
                continue
            blocked = True
            if waited > self.timeout:
                late = [r for r in range(self.size) if self._counters[r] < count]
                raise RankFailure(f"rank {self.rank}: a collective over shared memory waited {self.timeout:g} s "
                                  f"for rank(s) {late}: another rank stopped or did not answer (look for its own "
                                  "error above)")
            # Drained before the counters are read again: a peer's byte written after that read wakes the select.
            select.select([self._wake], [], [], min(1.0, self.timeout))
            try:
                os.read(self._wake, 1 << 16)
            except BlockingIOError:
                pass
        self.polling = adapted_polling(self.polling, blocked, self.spin)

    def _pieces(self, x: torch.Tensor) -> list[torch.Tensor]:
        flat = x.detach().contiguous().reshape(-1).view(torch.uint8)
        step = SLOT_BYTES - SLOT_BYTES % x.element_size()
        return [flat[i:i + step] for i in range(0, flat.numel(), step)] or [flat]

    def _check_open(self) -> None:
        settle(self)  # every collective begins here
        if self.closed:
            raise RankFailure(f"rank {self.rank}: this parallel module was closed (its process groups released); "
                              "build a new one with autotp.parallelize")

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of ``x`` over the ranks, added in rank order on every rank (the same bits everywhere)."""
        self._check_open()
        views = self._slot_views(x)
        if views is not None:
            views[self.rank].copy_(x)
            self._arrive()
            return _sum_in_order(views)
        out = []
        for piece in self._pieces(x):
            out.append(_sum_in_order([p.view(x.dtype) for p in self._exchange(piece)]))
        return torch.cat(out).view(x.shape) if len(out) > 1 else out[0].view(x.shape)

    def all_gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``x``, in rank order."""
        self._check_open()
        views = self._slot_views(x)
        if views is not None:
            views[self.rank].copy_(x)
            self._arrive()
            return [v.clone() for v in views]
        gathered: list[list[torch.Tensor]] = [[] for _ in range(self.size)]
        for piece in self._pieces(x):
            for r, p in enumerate(self._exchange(piece)):
                gathered[r].append(p.clone())
        return [torch.cat(g).view(x.dtype).view(x.shape) for g in gathered]

    def all_gather_started(self, x: torch.Tensor) -> Callable[[], list[torch.Tensor]]:
        """``all_gather(x)``, done at once (as ``all_reduce_started``)."""
        parts = self.all_gather(x)
        return lambda: parts

    def all_reduce_started(self, x: torch.Tensor) -> Callable[[], torch.Tensor]:
        """``all_reduce(x)``, done at once (nothing to overlap: the peers answer in microseconds)."""
        out = self.all_reduce(x)
        return lambda: out

    def all_to_all(self, x: torch.Tensor, send: list[int], receive: list[int]) -> torch.Tensor:
        """Rows of ``x`` exchanged, as ``Communicator.all_to_all`` says (an expert dispatch while generating): every
        rank's rows gathered, padded to the longest, and the rows sent to this rank taken (on one host the copies
        are the cost, not the bytes)."""
        sends = [s.tolist() for s in self.all_gather(torch.tensor(send, dtype=torch.int64))]
        longest = max(sum(s) for s in sends)
        if longest == 0:
            return x[:0]
        padded = x.new_zeros((longest, *x.shape[1:]))
        padded[:sum(send)] = x[:sum(send)]
        parts = self.all_gather(padded)
        return torch.cat([part[sum(s[:self.rank]):][:n] for part, s, n in zip(parts, sends, receive)])

    def reduce_scatter(self, pieces: list[torch.Tensor]) -> torch.Tensor:
        """The sum over the ranks of their ``pieces[rank]``."""
        return self.all_reduce(torch.stack(pieces))[self.rank]

    def close(self) -> None:
        """Unmap the shared file (a later collective raises ``RankFailure``)."""
        self.closed = True
        self._views = {}
        self._counters = None
        self._slots = None
        self._map.close()
        for fd in (self._wake, *(fd for _, fd in self._peers)):
            os.close(fd)
        self._peers = []


def _sum_in_order(parts: list[torch.Tensor]) -> torch.Tensor:
    """``parts[0] + parts[1] + ...``, added left to right (a new tensor)."""
    total = parts[0] + parts[1] if len(parts) > 1 else parts[0].clone()
    for p in parts[2:]:
        total += p
    return total


def _file_bytes(size: int) -> int:
    return size * _LINE + 2 * size * SLOT_BYTES


def same_host(comm: Communicator | None) -> Communicator | None:
    """A ``SharedMemoryComm`` over ``comm``'s ranks when they are CPU processes of one x86 host (collective over
    its group); else ``comm`` itself."""
    if not isinstance(comm, TorchComm) or comm.size == 1 or dist.get_backend(comm.group) != "gloo":
        return comm
    here = (socket.gethostname(), platform.machine() in ("x86_64", "AMD64"), os.path.isdir("/dev/shm"))
    everyone = [None] * comm.size
    dist.all_gather_object(everyone, here, group=comm.group)
    if any(e != everyone[0] for e in everyone) or not all(everyone[0][1:]):
        return comm
    folder = [None]
    if comm.rank == 0:
        folder[0] = make_folder(comm.size)
    first = dist.get_global_rank(comm.group, 0) if comm.group is not None else 0
    dist.broadcast_object_list(folder, src=first, group=comm.group)
    timeout = (group_timeout() or timedelta(minutes=10)).total_seconds()  # as long as gloo would wait
    try:
        shared = SharedMemoryComm(comm.rank, comm.size, folder[0], timeout, spin_seconds(_processes_here()))
        dist.barrier(group=comm.group)  # every rank reads its pipe: the peers' can be opened for writing
        shared.connect()
    finally:
        dist.barrier(group=comm.group)  # every rank has opened everything (or failed): the names can go
        if comm.rank == 0:
            shutil.rmtree(folder[0])
    return shared


def _processes_here() -> int:
    """The processes of this job on this host: torchrun's ``LOCAL_WORLD_SIZE``, else the whole world (one host)."""
    local = os.environ.get("LOCAL_WORLD_SIZE", "")
    return int(local) if local.isdigit() else dist.get_world_size()


def make_folder(size: int) -> str:
    """A new folder in /dev/shm holding the shared file and one named pipe per rank."""
    folder = tempfile.mkdtemp(prefix="autotp-comm-", dir="/dev/shm")
    with open(os.path.join(folder, "memory"), "wb") as f:
        f.truncate(_file_bytes(size))
    for r in range(size):
        os.mkfifo(_pipe(folder, r))
    return folder


def _pipe(folder: str, rank: int) -> str:
    return os.path.join(folder, f"wake-{rank}")
