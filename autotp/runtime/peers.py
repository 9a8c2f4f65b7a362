"""Failures across ranks: bounded by the group's timeout, and named after the rank that failed.

A rank that raises, hangs or dies leaves its peers blocked in a collective or a pipeline send; gloo ends
that wait after the group's timeout with an error that names only the rank that noticed. Records in the
c10d store (the one every rank already reaches) let the peers name the culprit instead:

- ``autotp/calls/<rank>``: how many parallel calls (``step``, ``forward``, ...) the rank has begun. Every
  rank makes the same calls in the same order, so a rank whose count is behind stopped or hangs before the
  call its peers are blocked in.
- ``autotp/failed/<rank>``: the call number and the first line of the error a rank raised itself in it.
- ``autotp/blamed/<rank>``: set by a peer that found the rank behind; the rank's watchdog thread then records
  the failure (torchrun's error file) and exits first, so that torchrun's root cause is the hung rank.

Groups autotp creates (the mesh's, the tied weights') are made with the default group's timeout
(``group_timeout``; ``parallelize(timeout=)`` sets it with ``bound_groups``): torch's ``new_group`` would
give them its own default of 30 minutes, and a group's sends and receives keep the timeout it was made
with, so a pipeline outlived a smaller ``timeout=``. The torch internals read here (``_set_pg_timeout``,
a backend's ``options._timeout``, ``_get_default_store``) are private; a torch that renames them fails here.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import sys
import threading
import time
from collections.abc import Iterable
from datetime import timedelta

import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from autotp.errors import AutotpError, RankFailure

_PREFIX = "autotp/"
_calls = 0
"""Parallel calls this process has begun (the store's ``calls`` key): process-wide, as every rank's calls
line up whichever module makes them."""
_depth = 0


def group_timeout() -> timedelta | None:
    """The default group's timeout (as ``parallelize(timeout=)`` or ``init_process_group`` set it), or None
    without a group."""
    if _store() is None:
        return None
    for device in dist.group.WORLD._device_types:
        options = getattr(dist.group.WORLD._get_backend(device), "options", None)
        if options is not None:
            return options._timeout
    return None


def as_timedelta(seconds: float | timedelta) -> timedelta:
    """``seconds`` as a timedelta (a timedelta passes unchanged)."""
    return seconds if isinstance(seconds, timedelta) else timedelta(seconds=float(seconds))


def bound_groups(groups: Iterable, timeout: timedelta | None = None) -> None:
    """Give each process group (None entries skipped) ``timeout``, default the default group's, so that a
    peer that hangs stops this rank within it in every group autotp uses."""
    timeout = timeout or group_timeout()
    if timeout is None:
        return
    for group in groups:
        if group is not None and not c10d._rank_not_in_group(group):
            c10d._set_pg_timeout(timeout, group)


def _store():
    if not (dist.is_available() and dist.is_initialized()):
        return None
    try:
        return c10d._get_default_store()
    except (RuntimeError, ValueError):  # a group made from a store the caller no longer exposes
        return None


@contextlib.contextmanager
def guarded(what: str):
    """Run one parallel call (``what``: "step", "forward", ...) so that a failure is named across ranks.

    A failure this rank meets in communication becomes ``RankFailure`` naming the peer that stopped, when the
    store tells; an error of this rank's own is recorded for its peers, then raised unchanged. Nested calls
    (``step`` running ``forward``) count once.
    """
    global _calls, _depth
    store = _store()
    if store is None or _depth:
        _depth += 1
        try:
            yield
        finally:
            _depth -= 1
        return
    _calls += 1
    _depth += 1
    rank = dist.get_rank()
    _start_watchdog()
    try:
        _set(store, f"calls/{rank}", str(_calls))
        yield
    except Exception as e:
        if not _is_peer_failure(e):
            # Tagged with the call: a failure every rank raised and got past must not be blamed for a later one.
            _set(store, f"failed/{rank}", f"{_calls} {type(e).__name__}: {_first_line(e)}")
            raise
        told, behind = culprit(store, rank, _calls)
        failure = RankFailure(f"rank {rank}: {what} #{_calls} could not finish: {told} "
                              f"(this rank saw: {_first_line(e)})")
        _blame(store, behind, failure)
        raise failure from e
    finally:
        _depth -= 1


def _is_peer_failure(e: BaseException) -> bool:
    """Whether ``e`` is what a peer's failure looks like from here: autotp's ``RankFailure``, gloo's errors
    (raw in torch's pipeline schedules), and the schedules' wrappers around them."""
    if isinstance(e, RankFailure):
        return True
    if isinstance(e, AutotpError):
        return False
    seen = e
    while seen is not None:
        text = str(seen).lower()
        if isinstance(seen, dist.DistError) or any(w in text for w in ("gloo", "connection", "timed out")):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def culprit(store, rank: int, calls: int) -> tuple[str, list[int]]:
    """Which peer failed, as far as the store tells: one that recorded its own error, else one whose call count
    is behind ``calls`` (also returned: those ranks, stopped or hung); else a sentence saying it could not be
    told."""
    world = dist.get_world_size()
    peers = [r for r in range(world) if r != rank]
    failed = [(r, (_get(store, f"failed/{r}") or "").partition(" ")) for r in peers]
    failed = [(r, message) for r, (call, _, message) in failed if call == str(calls)]
    if failed:
        return "; ".join(f"rank {r} failed: {message}" for r, message in failed), []
    behind, said = [], []
    for r in peers:
        seen = _get(store, f"calls/{r}")
        if seen is None or int(seen) < calls:
            behind.append(r)
            said.append(f"rank {r} (it began {seen or 0} of these calls)")
    if behind:
        return (f"{', '.join(said)} stopped or hangs before call #{calls}: look at that rank's own output; "
                "timeouts: parallelize(timeout=...)"), behind
    return ("another rank stopped or did not answer within the group's timeout (every rank began this call, so "
            "which one could not be told: look for an error on the others)"), []


_GRACE = 3.0
"""Seconds a rank that named hung peers waits for them to exit first (see ``_blame``)."""
_POLL = 1.0
"""Seconds between the watchdog's looks at whether a peer named this rank as hung."""
_watchdog = None
_stopping = threading.Event()
"""Set at exit: the watchdog stops before the process groups and their store are torn down (a thread inside a
store call while its C++ client is destroyed aborts the process)."""


def _blame(store, ranks: list[int], failure: RankFailure) -> None:
    """Tell ``ranks`` (behind: hung, or dead) that they stopped the others, and give a hung one ``_GRACE``
    seconds to exit first: torchrun reports the failure with the earliest time (whole seconds) as the root
    cause, which must be the hung rank, not the healthy one that noticed."""
    if not ranks:
        return
    for r in ranks:
        _set(store, f"blamed/{r}", str(failure))
    deadline = time.monotonic() + _GRACE
    while time.monotonic() < deadline:
        if all(_get(store, f"gone/{r}") is not None for r in ranks):
            time.sleep(1.1)  # a later second than the hung rank's error file
            return
        time.sleep(0.1)


def _start_watchdog() -> None:
    """Once per process: a daemon thread that ends this process when a peer names it as hung (its error
    recorded for torchrun first, see ``_blame``). A rank stuck in Python (a sleep, a data loader) is reached;
    one stuck in C++ holding the GIL is not, and torchrun then stops it itself."""
    global _watchdog
    if _watchdog is not None:
        return
    _watchdog = threading.Thread(target=_watch, name="autotp-peers", daemon=True)
    _watchdog.start()
    atexit.register(_stop_watchdog)  # registered after the groups' closers, so it runs before them


def _stop_watchdog() -> None:
    _stopping.set()
    if _watchdog is not None:
        _watchdog.join(timeout=5 * _POLL)


def _watch() -> None:
    while not _stopping.wait(_POLL):
        try:
            store = _store()
            rank = dist.get_rank() if store is not None else -1
            blamed = _get(store, f"blamed/{rank}") if store is not None else None
        except (RuntimeError, ValueError):  # the group went away between two looks: look again later
            continue
        if blamed is None:
            continue
        hung = RankFailure(f"rank {rank} did not answer its peers within the timeout (hung?); a peer reported: "
                           f"{blamed}")
        _record_for_torchrun(hung)
        print(f"autotp: {hung}", file=sys.stderr, flush=True)
        _set(store, f"gone/{rank}", "1")
        os._exit(EXIT_HUNG)


def _record_for_torchrun(failure: RankFailure) -> None:
    """``failure`` in torchrun's error file (when torchrun set one), as ``@record`` writes it; the message as the
    traceback, which torchrun prints with the root cause (this thread has no traceback worth showing)."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    message = f"{type(failure).__name__}: {failure}"
    data = {"message": {"message": message, "extraInfo": {"py_callstack": message,
                                                          "timestamp": str(int(time.time()))}}}
    with open(path, "w") as f:
        json.dump(data, f)


EXIT_HUNG = 75
"""The exit code of a rank ended by its watchdog because its peers found it hung."""


def _set(store, key: str, value: str) -> None:
    try:
        store.set(_PREFIX + key, value)
    except (RuntimeError, dist.DistError):  # the store's host (rank 0) is gone: nothing left to tell
        pass


def _get(store, key: str) -> str | None:
    """The key's value, or None if it is not set (never waits for it)."""
    try:
        if not store.check([_PREFIX + key]):
            return None
        return store.get(_PREFIX + key).decode()
    except (RuntimeError, dist.DistError):
        return None


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]
