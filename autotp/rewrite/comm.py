"""Who the rank modules talk to: a torch process group, or (for the one-process checker) threads.

The collectives the rewrite inserts call a ``Communicator``; the runtime gives them a ``TorchComm`` over
a process group, the checker a ``ThreadComm`` that runs every simulated rank in one process. A
``TorchComm`` over the default group holds no reference to it (torch's ``None``), so
``destroy_process_group`` really frees it; ``close()`` drops any other group reference.

Every communicator runs its one-shot ``pending`` wait (``settle``) before its next collective: a check begun
before a forward (``runtime.batch_agreement``) completes there, overlapping the local compute before it, yet before
any collective whose shapes it vouches for.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterable
from typing import Protocol

import torch
import torch.distributed as dist

from autotp.errors import RankFailure


class Communicator(Protocol):
    """The collectives rank modules need, over ``size`` ranks of which this is ``rank``."""

    rank: int
    size: int
    pending: Callable[[], None] | None
    """Run (once, then cleared) before this communicator's next collective: see ``settle``."""

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of ``x`` over the ranks (a new tensor)."""

    def all_gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``x``, in rank order."""

    def reduce_scatter(self, pieces: list[torch.Tensor]) -> torch.Tensor:
        """The sum over the ranks of their ``pieces[rank]`` (one piece per rank, all of one shape)."""

    def all_gather_started(self, x: torch.Tensor) -> Callable[[], list[torch.Tensor]]:
        """``all_gather(x)`` begun (pass a tensor nothing writes until it is done): returns the function that waits
        for it and gives every rank's ``x``."""

    def all_reduce_started(self, x: torch.Tensor) -> Callable[[], torch.Tensor]:
        """``all_reduce(x)`` begun, in place when ``x`` is contiguous (pass a tensor nothing else reads): returns
        the function that waits for it and gives the sum, so that work in between overlaps the communication."""

    def all_to_all(self, x: torch.Tensor, send: list[int], receive: list[int]) -> torch.Tensor:
        """Rows of ``x`` exchanged: the ``send[r]`` rows after ``sum(send[:r])`` go to rank ``r``; the result holds
        the ``receive[r]`` rows rank ``r`` sent this rank, in rank order (variable sizes: an expert dispatch)."""

    def ring_shift_started(self, x: torch.Tensor) -> Callable[[], torch.Tensor]:
        """``x`` sent to the next rank of the ring, the previous rank's received (pass a tensor nothing writes
        until it is done): returns the function that waits and gives the previous rank's ``x``."""


def all_gather_chunks(comm: Communicator, x: torch.Tensor, dim: int, lengths: list[int]) -> list[torch.Tensor]:
    """Every rank's ``x``, of ``lengths[rank]`` along ``dim`` (a vocabulary cut unevenly): padded to the longest
    for the collective, which takes equal shapes, and trimmed after."""
    longest = max(lengths)
    if min(lengths) == longest:
        return comm.all_gather(x)
    padded = torch.nn.functional.pad(x.movedim(dim, -1), (0, longest - x.shape[dim])).movedim(-1, dim)
    return [part.narrow(dim, 0, length) for part, length in zip(comm.all_gather(padded), lengths)]


def settle(comm) -> None:
    """Run and clear ``comm.pending`` (each communicator calls this as a collective begins)."""
    pending, comm.pending = comm.pending, None
    if pending is not None:
        pending()


class TorchComm:
    """Collectives over a torch.distributed group (``None``: the default group, held by name only)."""

    def __init__(self, group=None):
        self.group = group
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
        self.closed = False
        self.pending: Callable[[], None] | None = None
        self.shifts = 0
        """Ring shifts begun: each one's tag, so that two in flight between the same ranks never cross."""

    def _run(self, what: str, call):
        settle(self)
        if self.closed:
            raise RankFailure(f"rank {self.rank}: this parallel module was closed (its process groups released); "
                              "build a new one with autotp.parallelize")
        try:
            return call()
        except (RuntimeError, dist.DistError) as e:  # a peer died or timed out: say so, from this rank's side
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise RankFailure(f"rank {self.rank}: {what} over {self.size} ranks failed: another rank stopped or did "
                              f"not answer within the group's timeout (look for its own error above): {first}") from e

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        out = x.contiguous().clone()
        self._run("all_reduce", lambda: dist.all_reduce(out, group=self.group))
        return out

    def all_gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        parts = [torch.empty_like(x) for _ in range(self.size)]
        self._run("all_gather", lambda: dist.all_gather(parts, x.contiguous(), group=self.group))
        return parts

    def all_gather_started(self, x: torch.Tensor) -> Callable[[], list[torch.Tensor]]:
        out = x.new_empty(self.size * x.numel())  # flat, rank r's at r's place: the form gloo takes
        work = self._run("all_gather", lambda: dist.all_gather_single(out, x.contiguous().reshape(-1),
                                                                      group=self.group, async_op=True))

        def finish() -> list[torch.Tensor]:
            self._run("all_gather", work.wait)
            return list(out.view(self.size, *x.shape).unbind(0))
        return finish

    def all_reduce_started(self, x: torch.Tensor) -> Callable[[], torch.Tensor]:
        out = x.contiguous()
        work = self._run("all_reduce", lambda: dist.all_reduce(out, group=self.group, async_op=True))

        def finish() -> torch.Tensor:
            self._run("all_reduce", work.wait)
            return out
        return finish

    def all_to_all(self, x: torch.Tensor, send: list[int], receive: list[int]) -> torch.Tensor:
        out = x.new_empty((sum(receive), *x.shape[1:]))
        # gloo runs all_to_all_single with variable split sizes as NCCL does (checked on torch 2.13): each rank
        # receives only the rows sent to it, so the bytes counted are those the NCCL path moves
        self._run("all_to_all", lambda: dist.all_to_all_single(out, x.contiguous(), receive, send, group=self.group))
        return out

    def reduce_scatter(self, pieces: list[torch.Tensor]) -> torch.Tensor:
        mine = pieces[self.rank]
        out = mine.new_empty(mine.numel())
        # Flat, rank r's piece at r's place: the concatenated form, the one gloo takes.
        whole = torch.cat([p.reshape(-1) for p in pieces])
        self._run("reduce_scatter", lambda: dist.reduce_scatter_single(out, whole, group=self.group))
        return out.view(mine.shape)

    def ring_shift_started(self, x: torch.Tensor) -> Callable[[], torch.Tensor]:
        x, out = x.contiguous(), torch.empty_like(x, memory_format=torch.contiguous_format)
        peers = [dist.get_global_rank(self.group, (self.rank + step) % self.size) if self.group is not None
                 else (self.rank + step) % self.size for step in (1, -1)]
        self.shifts += 1
        tag = self.shifts % 1024
        works = self._run("ring shift", lambda: [dist.isend(x, peers[0], group=self.group, tag=tag),
                                                 dist.irecv(out, peers[1], group=self.group, tag=tag)])

        def finish() -> torch.Tensor:
            self._run("ring shift", lambda: [w.wait() for w in works])
            return out
        return finish

    def close(self) -> None:
        """Drop the group reference (a later collective raises ``RankFailure``)."""
        self.group, self.closed = None, True


class _Rendezvous:
    """What the threads of one simulated group share: a barrier and a slot per rank."""

    def __init__(self, size: int, timeout: float):
        self.timeout = timeout
        self.barrier = threading.Barrier(size, timeout=timeout)
        self.slots: list[torch.Tensor | None] = [None] * size


EXIT_WAIT_S = 1.0
"""How long ``join_fully`` waits for a joined thread to leave the operating system."""


def join_fully(threads: Iterable[threading.Thread]) -> None:
    """Join ``threads``, then wait (up to ``EXIT_WAIT_S`` each, on Linux) until each has left the OS too.

    ``join`` returns once a thread's Python part is done, while the thread may still run C libraries' exit
    handlers: MKL's frees the thread's buffers holding its allocator's lock. A process that forks in that moment
    (the tests' ranks, a DataLoader's workers) copies the lock held, and the child spins forever in its first
    matrix product: ``python -m bench.fork_hangs`` hung 7 of 600 forks after ``Thread.join``, 0 of 600 after this.
    """
    for thread in threads:
        thread.join()
        task, deadline = f"/proc/self/task/{thread.native_id}", time.monotonic() + EXIT_WAIT_S
        while os.path.exists(task) and time.monotonic() < deadline:
            time.sleep(0.0002)


class ThreadComm:
    """Collectives between threads of one process, one thread per simulated rank (the checker's)."""

    def __init__(self, rendezvous: _Rendezvous, rank: int):
        self.shared, self.rank, self.size = rendezvous, rank, len(rendezvous.slots)
        self.dropped: set[int] = set()
        """Indices of this rank's all-reduces to skip (the checker's fault injection)."""
        self.calls = 0
        self.pending: Callable[[], None] | None = None

    @classmethod
    def group(cls, size: int, timeout: float = 120.0) -> list[ThreadComm]:
        """One communicator per rank of a new simulated group."""
        shared = _Rendezvous(size, timeout)
        return [cls(shared, r) for r in range(size)]

    def _exchange(self, x: torch.Tensor) -> list[torch.Tensor]:
        settle(self)
        try:
            self.shared.barrier.wait()  # the slots of the previous collective have been read
            self.shared.slots[self.rank] = x.detach().clone()
            self.shared.barrier.wait()
            parts = list(self.shared.slots)
            self.shared.barrier.wait()
        except threading.BrokenBarrierError as e:
            raise RankFailure(f"simulated rank {self.rank}: another simulated rank failed or took longer than "
                              f"{self.shared.timeout} s") from e
        return parts

    def abort(self) -> None:
        """Release the other ranks' threads (this rank failed)."""
        self.shared.barrier.abort()

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        parts = self._exchange(x)
        self.calls += 1
        if self.calls - 1 in self.dropped:
            return x.contiguous().clone()
        out = parts[0].clone()
        for p in parts[1:]:
            out += p
        return out

    def all_gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        return self._exchange(x)

    def all_gather_started(self, x: torch.Tensor) -> Callable[[], list[torch.Tensor]]:
        parts = self._exchange(x)  # threads exchange at once
        return lambda: parts

    def all_reduce_started(self, x: torch.Tensor) -> Callable[[], torch.Tensor]:
        out = self.all_reduce(x)  # threads exchange at once; the faults injected into all_reduce apply
        return lambda: out

    def all_to_all(self, x: torch.Tensor, send: list[int], receive: list[int]) -> torch.Tensor:
        parts = self._exchange(x)
        sent = self._exchange(torch.tensor(send))  # where each rank's rows for this one start
        out = [p[int(s[:self.rank].sum()):][:n] for p, s, n in zip(parts, sent, receive)]
        return torch.cat(out) if out else x[:0]

    def ring_shift_started(self, x: torch.Tensor) -> Callable[[], torch.Tensor]:
        arrived = self._exchange(x)[(self.rank - 1) % self.size]  # threads exchange at once
        return lambda: arrived

    def reduce_scatter(self, pieces: list[torch.Tensor]) -> torch.Tensor:
        parts = self._exchange(torch.stack(pieces))
        out = parts[0][self.rank].clone()
        for p in parts[1:]:
            out += p[self.rank]
        return out
