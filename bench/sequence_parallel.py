"""Sequence parallelism: bytes each rank saves for backward, communication and step time, with and without.

    python -m bench.sequence_parallel [--rounds 15]

Two gloo ranks on the CPU (one thread each) step the runtime benchmark's GPT (4 x 256, vocabulary 8192, batch
4 x 128), with dropout 0.1 so that its masks count too, at tp=2 through ``pm.step(x, target=y)`` from
``parallelize(...)`` and ``parallelize(..., sequence_parallel=True)``. Saved bytes are the storages autograd
keeps for backward during one forward (parameters excluded; ``bench.memory.SavedActivations``); collectives are
counted at run time (payloads: a collective's whole tensor); a step's time is the slower rank's, alternating,
with paired ratios and 95% bootstrap intervals. Megatron's paper (arXiv 2205.05198, Table 2) gives
sbh(10 + 24/t) bytes per layer before and 34·sbh/t after, without the attention scores' 5as²b term.
"""

from __future__ import annotations

from pathlib import Path

import torch

import autotp
from autotp.passes.steps import CollectiveOp, ring_share
from bench.comm import count_calls
from bench.config import ModelShape
from bench.memory import SavedActivations
from bench.runtime import alternate, two_rank_command
from bench.stats import paired_ratio, summary, with_interval
from examples.gpt import build_gpt

SHAPE = ModelShape(n_layer=4, n_head=8, n_embd=256, vocab_size=8192, batch=4, seq=128)
MODES = {"plain": False, "sequence parallel": True}
RESULTS = Path(__file__).parent / "results" / "sequence_parallel.json"


def _saved_bytes(pm, x, y) -> int:
    saved = SavedActivations(list(pm.parameters()))
    with saved:
        loss = pm.loss(x, target=y)
    loss.backward()
    _drop_grads(pm)
    return saved.bytes


def _drop_grads(pm) -> None:
    for p in pm.parameters():
        p.grad = None


def _measure(rank: int, world: int, rounds: int) -> dict:
    torch.manual_seed(0)
    return compare(build_gpt(**(SHAPE.gpt_kwargs() | {"dropout": 0.1})), SHAPE.describe(), world, rounds)


def compare(model, shape: str, world: int, rounds: int) -> dict:
    """``model`` (of ``SHAPE``'s vocabulary, batch and sequence; described by ``shape``) at tp=``world`` with and
    without sequence parallelism: losses, bytes saved for backward, collectives of a step, alternating step times
    and their paired ratio (collective: every rank calls it)."""
    gen = torch.Generator().manual_seed(1)
    x, y = (torch.randint(0, SHAPE.vocab_size, (SHAPE.batch, SHAPE.seq), generator=gen) for _ in range(2))
    pms = {mode: autotp.parallelize(model, tp=world, example_inputs=x, vocab="split", sequence_parallel=sp)
           for mode, sp in MODES.items()}
    losses = {}
    for mode, pm in pms.items():
        pm.manual_seed(3)
        losses[mode] = pm.loss(x, target=y).item()
    saved = {mode: _saved_bytes(pm, x, y) for mode, pm in pms.items()}
    comm = {mode: count_calls(lambda pm=pm: (pm.step(x, target=y), _drop_grads(pm))) for mode, pm in pms.items()}
    samples = alternate({mode: (lambda pm=pm: (pm.step(x, target=y), _drop_grads(pm))) for mode, pm in pms.items()},
                        rounds)
    return {"shape": shape, "tp": world, "losses": losses, "saved bytes per rank": saved, "collectives": comm,
            "times": {m: summary(s) for m, s in samples.items()},
            "sequence parallel / plain": paired_ratio(samples["sequence parallel"], samples["plain"])}


def table(r: dict) -> str:
    """The results as a Markdown table."""
    mib = 2 ** 20
    lines = ["| | plain | sequence parallel | ratio |", "|---|---|---|---|"]
    saved = r["saved bytes per rank"]
    lines.append(f"| saved for backward per rank | {saved['plain'] / mib:.2f} MiB | "
                 f"{saved['sequence parallel'] / mib:.2f} MiB | {saved['sequence parallel'] / saved['plain']:.3f} |")
    kinds = {m: ", ".join(f"{e['count']} {k}" for k, e in sorted(c.items())) for m, c in r["collectives"].items()}
    lines.append(f"| collectives per step | {kinds['plain']} | {kinds['sequence parallel']} | |")
    moved = {m: sum(e["bytes"] for e in c.values()) for m, c in r["collectives"].items()}
    lines.append(f"| their payloads | {moved['plain'] / mib:.2f} MiB | {moved['sequence parallel'] / mib:.2f} MiB | "
                 f"{moved['sequence parallel'] / moved['plain']:.3f} |")
    sent = {m: sum(e["bytes"] * ring_share(CollectiveOp(k), r["tp"]) for k, e in c.items())
            for m, c in r["collectives"].items()}
    lines.append(f"| bytes each rank sends (ring) | {sent['plain'] / mib:.2f} MiB | "
                 f"{sent['sequence parallel'] / mib:.2f} MiB | {sent['sequence parallel'] / sent['plain']:.3f} |")
    t, ratio = r["times"], r["sequence parallel / plain"]
    lines.append(f"| step time (median) | {t['plain']['median'] * 1e3:.1f} ms | "
                 f"{t['sequence parallel']['median'] * 1e3:.1f} ms | {with_interval(ratio)} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    """Measure, print the table, write ``bench/results/sequence_parallel.json``."""
    command(_measure, __doc__, RESULTS, argv)


def command(measure, doc: str, results: Path, argv=None) -> None:
    """Run ``measure`` on two ranks with the command line ``argv`` (``doc`` its help), write ``results``, print
    the shape, the losses and the table."""
    r = two_rank_command(measure, doc, results, argv)
    print(f"{r['shape']}; losses {r['losses']}")
    print(table(r))


if __name__ == "__main__":
    main()
