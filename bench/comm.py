"""Collectives per training step, counted at run time, against Megatron's analytic minimum.

Counts come from torch's ``CommDebugMode``; bytes from ``CommBytes``, a dispatch mode of our own that
sees the same collective ops and sums their payloads. The payload of a collective is the size of the
whole tensor it produces (an all-reduce's tensor, an all-gather's gathered result), which is how
Megatron's cost is usually written.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable

import torch
from torch.distributed.tensor.debug import CommDebugMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from bench.config import ModelShape

# c10d op (eager torch.distributed and its functional form) -> (collective, where its payload is).
_PAYLOAD = {
    "allreduce_": ("all_reduce", "args0"),
    "all_reduce": ("all_reduce", "args0"),
    "allgather_": ("all_gather", "args0"),
    "_allgather_base_": ("all_gather", "args0"),
    "all_gather_into_tensor": ("all_gather", "out"),
    "reduce_scatter_tensor": ("reduce_scatter", "args0"),
    "_reduce_scatter_base_": ("reduce_scatter", "args1"),
    "all_to_all_single": ("all_to_all", "out"),
    "alltoall_base_": ("all_to_all", "args0"),  # torch.distributed.all_to_all_single's c10d op (its output first)
    "broadcast_": ("broadcast", "args0"),
}


def _nbytes(tree) -> int:
    return sum(t.numel() * t.element_size() for t in tree_leaves(tree) if isinstance(t, torch.Tensor))


class CommBytes(TorchDispatchMode):
    """Records every collective dispatched inside it: ``events`` is a list of (collective, bytes)."""

    def __init__(self):
        super().__init__()
        self.events: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        namespace, name = func.namespace, func._overloadpacket.__name__
        if "c10d" in namespace and name in _PAYLOAD:
            what, where = _PAYLOAD[name]
            payload = out if where == "out" else args[int(where[-1])]
            self.events.append((what, _nbytes(payload)))
        return out


def _debug_counts(mode: CommDebugMode) -> dict[str, int]:
    """CommDebugMode's counts under our names (``allreduce_`` and ``all_reduce`` are both all_reduce)."""
    out: dict[str, int] = {}
    for op, n in mode.get_comm_counts().items():
        what = _PAYLOAD.get(op.__name__, (op.__name__, ""))[0]
        out[what] = out.get(what, 0) + n
    return out


def _tally(events: list[tuple[str, int]]) -> dict[str, dict]:
    out: dict[str, dict] = {}
    for what, nbytes in events:
        entry = out.setdefault(what, {"count": 0, "bytes": 0})
        entry["count"] += 1
        entry["bytes"] += nbytes
    return out


@contextlib.contextmanager
def _counting():
    # ModTracker (inside CommDebugMode) warns about module hooks on modules without tensor inputs.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        with CommDebugMode() as debug, CommBytes() as nbytes:
            yield debug, nbytes


def count_step(forward: Callable[[], object], loss_fn: Callable[[object], torch.Tensor]) -> dict:
    """Collectives of one training step, per direction: ``{forward: {all_reduce: {count, bytes}}, ...}``; the
    loss (``loss_fn(forward())``) counts as forward.

    The two counters must agree on the counts; a mismatch means one of them missed an op.
    """
    result = {}
    with _counting() as (fwd_debug, fwd_bytes):
        loss = loss_fn(forward())  # the loss's own collectives (a vocab-parallel one) belong to the forward
    with _counting() as (bwd_debug, bwd_bytes):
        loss.backward()
    for direction, debug, nbytes in (("forward", fwd_debug, fwd_bytes), ("backward", bwd_debug, bwd_bytes)):
        tally = _tally(nbytes.events)
        counted = {k: v["count"] for k, v in tally.items()}
        if counted != _debug_counts(debug):
            raise RuntimeError(f"{direction}: CommDebugMode counted {_debug_counts(debug)}, CommBytes {counted}")
        result[direction] = tally
    return result


def megatron_minimum(shape: ModelShape, itemsize: int, vocab_parallel_loss: bool = True) -> dict[str, dict]:
    """Megatron's collectives for one training step of examples.gpt's GPT, vocabulary split.

    Forward: one all-reduce after each attention and MLP (g), one after the vocabulary-split embedding, and
    the loss: Megatron's vocab-parallel cross-entropy all-reduces three (B, T) statistics (the max, the sum
    of exponentials, the target logit); without it (``vocab_parallel_loss=False``, as inference does) one
    all-gather of the (B, T, V) logits. Backward: one all-reduce before each attention and MLP (f) and one
    before the LM head. Every other all-reduce carries a (B, T, D) tensor.
    """
    act = shape.batch * shape.seq * shape.n_embd * itemsize
    reduces = 2 * shape.n_layer + 1
    forward = {"all_reduce": {"count": reduces, "bytes": reduces * act}}
    if vocab_parallel_loss:
        forward["all_reduce"] = {"count": reduces + 3, "bytes": reduces * act + 3 * shape.batch * shape.seq * itemsize}
    else:
        forward["all_gather"] = {"count": 1, "bytes": shape.batch * shape.seq * shape.vocab_size * itemsize}
    return {"forward": forward, "backward": {"all_reduce": {"count": reduces, "bytes": reduces * act}}}


def count_calls(run: Callable[[], object]) -> dict[str, dict]:
    """Collectives of ``run()`` (a whole training step such as ``pm.step``: forward and backward together),
    by collective: ``{all_reduce: {count, bytes}, ...}``; the two counters must agree."""
    with _counting() as (debug, nbytes):
        run()
    tally = _tally(nbytes.events)
    counted = {k: v["count"] for k, v in tally.items()}
    if counted != _debug_counts(debug):
        raise RuntimeError(f"CommDebugMode counted {_debug_counts(debug)}, CommBytes {counted}")
    return tally


def totals(step: dict[str, dict]) -> dict:
    """Count and bytes of a step summed over directions and collectives."""
    entries = [e for per_op in step.values() for e in per_op.values()]
    return {"count": sum(e["count"] for e in entries), "bytes": sum(e["bytes"] for e in entries)}
