"""What the peer checks cost per call, against a training step: ``python -m bench.peer_checks``.

Every call of a parallel module checks that its tensor-parallel ranks hold one batch (an all-gather of each
input's shape and fingerprint, begun before the graph runs and completed before its first collective) and
records in the c10d store that the rank began it (so that a failure can be named after the peer). Measured on
2 gloo ranks (tp=2) with the example GPT, against one ``pm.step`` and against Megatron's way of getting one
batch per group: Megatron-LM's ``get_batch_on_this_tp_rank`` broadcasts the group's first rank's tokens,
labels, loss mask and position ids (four broadcasts at pp=1, five with its default
``create_attention_mask_in_dataloader``), and the least any broadcast scheme can send, the token ids and the
target alone (two broadcasts).

The check overlaps the forward, so what it costs is what it adds to one: forwards with and without it, taken
in turn (pairs, each forward after a barrier, the slowest rank's time), the median of the pairs' differences;
and the time the check holds the forward up on its own (beginning it, and waiting for the all-gather at the first
collective: an upper bound, as that wait also absorbs the ranks' skew that the first collective would
otherwise wait out). The check made synchronously (before the graph, as pipelines do) is timed alone too.

Broadcasts and the synchronous check are timed as blocks of back-to-back calls between two barriers, and the
slowest rank's time is kept: a broadcast's root returns before its peers have received, so timing one call on
one rank would credit the broadcast with time its peers spend waiting in the next collective.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import autotp  # noqa: E402
from bench.ranks import run_on_ranks  # noqa: E402
from examples.gpt import build_gpt  # noqa: E402

SHAPES = [(8, 64, 150), (16, 256, 50)]
"""(batch, sequence) of the token ids (and the target), and how many pairs of forwards time the overlapped check."""


def _block_ms(call, repeats: int) -> float:
    """One call's time (ms) on the slowest rank: ``repeats`` calls back to back between two barriers."""
    dist.barrier()
    start = time.perf_counter()
    for _ in range(repeats):
        call()
    dist.barrier()
    mine = torch.tensor([(time.perf_counter() - start) / repeats])
    dist.all_reduce(mine, op=dist.ReduceOp.MAX)
    return 1e3 * float(mine)


def _interleaved_ms(calls: dict, repeats: int, rounds: int = 7) -> dict[str, float]:
    """Each call's median block time (ms) over ``rounds``, the calls taken in turn each round so that load
    from other processes (a shared machine) falls on all of them alike."""
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            times[name].append(_block_ms(call, repeats))
    return {name: statistics.median(t) for name, t in times.items()}


def _timed_checks(started, held: list[float]):
    """``inputs_started`` that appends to ``held`` the time each check holds its forward up: beginning it, and
    completing it (at the first collective, or after the graph)."""
    def begin(names, tensors, comm):
        start = time.perf_counter()
        complete = started(names, tensors, comm)
        began = time.perf_counter() - start
        finish = comm.pending

        def timed() -> None:
            at = time.perf_counter()
            finish()
            held.append(began + time.perf_counter() - at)
        comm.pending = timed
        return complete
    return begin


def _forward_pairs(forward, pairs: int) -> dict[str, float]:
    """What the batch check adds to ``forward`` (ms, slowest rank): the median over ``pairs`` of a forward with
    the check minus one without (taken in turn, alternating which goes first), and the median time it holds a
    forward up."""
    from autotp.runtime import tensor_module

    started, held = tensor_module.inputs_started, []
    timed = _timed_checks(started, held)

    def one(checked: bool) -> float:
        tensor_module.inputs_started = timed if checked else (lambda *_: lambda: None)
        try:
            dist.barrier()
            start = time.perf_counter()
            forward()
            return time.perf_counter() - start
        finally:
            tensor_module.inputs_started = started

    mine = []
    for i in range(pairs):
        order = (True, False) if i % 2 == 0 else (False, True)
        times = dict(zip(order, (one(order[0]), one(order[1]))))
        mine.append([times[True], times[False]])
    both = torch.tensor(mine + [[h, 0.0] for h in held])
    dist.all_reduce(both, op=dist.ReduceOp.MAX)
    pairs_ms, held_ms = 1e3 * both[:pairs], 1e3 * both[pairs:, 0]
    return {"added": float((pairs_ms[:, 0] - pairs_ms[:, 1]).median()), "with": float(pairs_ms[:, 0].median()),
            "without": float(pairs_ms[:, 1].median()), "held": float(held_ms.median())}


def measure(rank: int, world: int) -> dict:
    """Medians (ms, slowest rank) for each shape: a step, what the batch check adds to a forward and holds it up,
    the check made synchronously, the call record, Megatron's batch broadcasts and the least broadcast."""
    from autotp.runtime.batch_agreement import check_same_inputs
    from autotp.runtime.peers import guarded

    out = {}
    for batch, seq, pairs in SHAPES:
        torch.manual_seed(0)
        model = build_gpt(n_layer=4, n_head=4, n_embd=128, block_size=seq)
        gen = torch.Generator().manual_seed(1)
        x, y = (torch.randint(0, 128, (batch, seq), generator=gen) for _ in range(2))
        pm = autotp.parallelize(model, tp=world, example_inputs=(x,), quiet=True)
        for _ in range(3):
            pm.step(x, target=y)

        loss_mask = torch.ones(batch, seq)
        position_ids = torch.arange(seq).expand(batch, seq).contiguous()

        def megatron_get_batch():  # get_batch_on_this_tp_rank at pp=1, attention mask not made in the loader
            for t in (x, y, loss_mask, position_ids):
                dist.broadcast(t, src=0)

        def broadcast_least():
            dist.broadcast(x, src=0)
            dist.broadcast(y, src=0)

        def record():
            with guarded("bench"):
                pass

        def forward():
            with torch.no_grad():
                pm(x)

        out[f"{batch}x{seq}"] = _forward_pairs(forward, pairs) | _interleaved_ms({
            "check_alone": lambda: check_same_inputs(("idx", "target"), (x, y), pm.comm),
            "record": record,
            "megatron_get_batch": megatron_get_batch,
            "broadcast_least": broadcast_least,
        }, 100) | _interleaved_ms({"step": lambda: pm.step(x, target=y)}, 3, rounds=3)
    return out


def main() -> None:
    """Print each shape's medians on rank 0 and the checks' share of a step."""
    result = run_on_ranks(measure, "cpu", [1, 1])[0]
    for shape, ms in result.items():
        share = 100 * (max(ms["added"], 0.0) + ms["record"]) / ms["step"]
        print(f"batch x seq {shape}: step {ms['step']:.2f} ms; batch check overlapped: adds {ms['added']:.3f} ms to "
              f"a forward ({ms['with']:.2f} against {ms['without']:.2f} ms), holds it up {ms['held']:.3f} ms; call "
              f"record {ms['record']:.3f} ms ({share:.2f}% of a step); Megatron's get_batch "
              f"{ms['megatron_get_batch']:.3f} ms (held up / Megatron {ms['held'] / ms['megatron_get_batch']:.2f}x); "
              f"broadcasting ids and target alone {ms['broadcast_least']:.3f} ms; the check made synchronously "
              f"{ms['check_alone']:.3f} ms")


if __name__ == "__main__":
    main()
