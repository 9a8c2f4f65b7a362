"""What the peer checks cost per call, against a training step: ``python -m bench.peer_checks``.

Every call of a parallel module checks that its tensor-parallel ranks hold one batch (an all-gather of each
input's shape and fingerprint) and records in the c10d store that the rank began it (so that a failure can be
named after the peer). Measured on 2 gloo ranks (tp=2) with the example GPT, against one ``pm.step`` and
against Megatron's way of getting one batch per group: Megatron-LM's ``get_batch_on_this_tp_rank`` broadcasts
the group's first rank's tokens, labels, loss mask and position ids (four broadcasts at pp=1, five with its
default ``create_attention_mask_in_dataloader``), and the least any broadcast scheme can send, the token ids
and the target alone (two broadcasts).

Each call is timed as a block of back-to-back calls between two barriers, and the slowest rank's time is
kept: a broadcast's root returns before its peers have received, so timing one call on one rank would credit
the broadcast with time its peers spend waiting in the next collective.
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

SHAPES = [(8, 64), (16, 256)]
"""(batch, sequence) of the token ids (and the target)."""


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


def measure(rank: int, world: int) -> dict:
    """Medians (ms, slowest rank) for each shape: a step, the batch check, the call record, Megatron's batch
    broadcasts and the least broadcast."""
    from autotp.runtime.batch_agreement import check_same_inputs
    from autotp.runtime.peers import guarded

    out = {}
    for batch, seq in SHAPES:
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

        out[f"{batch}x{seq}"] = _interleaved_ms({
            "check": lambda: check_same_inputs(("idx", "target"), (x, y), pm.comm),
            "record": record,
            "megatron_get_batch": megatron_get_batch,
            "broadcast_least": broadcast_least,
        }, 100) | _interleaved_ms({"step": lambda: pm.step(x, target=y)}, 3, rounds=3)
    return out


def main() -> None:
    """Print each shape's medians on rank 0 and the checks' share of a step."""
    result = run_on_ranks(measure, "cpu", [1, 1])[0]
    for shape, ms in result.items():
        share = 100 * (ms["check"] + ms["record"]) / ms["step"]
        print(f"batch x seq {shape}: step {ms['step']:.2f} ms; batch check {ms['check']:.3f} ms, call record "
              f"{ms['record']:.3f} ms ({share:.2f}% of a step); Megatron's get_batch "
              f"{ms['megatron_get_batch']:.3f} ms (check / Megatron {ms['check'] / ms['megatron_get_batch']:.2f}x); "
              f"broadcasting ids and target alone {ms['broadcast_least']:.3f} ms")


if __name__ == "__main__":
    main()
