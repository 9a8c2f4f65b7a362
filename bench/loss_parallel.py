"""Communication of one training step at tp=2, counted at run time, against Megatron's analytic minimum.

    python -m bench.loss_parallel

Two gloo ranks on the CPU step examples.gpt's GPT (the runtime benchmark's shape, and one with a
32k-token vocabulary) through ``pm.step(x, target=y)``: the default loss, computed on the vocabulary-split
logits (Megatron's vocab-parallel cross-entropy). For comparison the same step with a ``loss_fn`` of the
user's (captured with the model, so its cross-entropy runs on the split logits too; before that capture the logits
were gathered for it, 2.77x the minimum), and Megatron's minimum with its vocab-parallel loss
(``bench.comm.megatron_minimum``). Bytes are payloads: a collective's whole tensor.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

import autotp
from bench.comm import count_calls, megatron_minimum
from bench.config import ModelShape
from bench.ranks import run_on_ranks
from examples.gpt import build_gpt

SHAPES = {
    "runtime GPT (4 x 256, vocab 8192)": ModelShape(n_layer=4, n_head=8, n_embd=256, vocab_size=8192, batch=4, seq=128),
    "32k vocabulary (4 x 256, vocab 32000)": ModelShape(n_layer=4, n_head=8, n_embd=256, vocab_size=32000, batch=4,
                                                        seq=128),
}
RESULTS = Path(__file__).parent / "results" / "loss_parallel.json"


def _bytes(tally: dict) -> int:
    return sum(entry["bytes"] for entry in tally.values())


def _user_loss(output, target):
    return torch.nn.functional.cross_entropy(output.flatten(0, 1), target.flatten())


def _measure(rank: int, world: int) -> dict:
    rows = {}
    for label, shape in SHAPES.items():
        torch.manual_seed(0)
        model = build_gpt(**shape.gpt_kwargs())
        gen = torch.Generator().manual_seed(1)
        x, y = (torch.randint(0, shape.vocab_size, (shape.batch, shape.seq), generator=gen) for _ in range(2))
        pm = autotp.parallelize(model, tp=world, example_inputs=x)
        split = count_calls(lambda: pm.step(x, target=y))
        gathered = count_calls(lambda: pm.step(x, target=y, loss_fn=_user_loss))
        minimum = megatron_minimum(shape, itemsize=4)
        low = sum(_bytes(per_direction) for per_direction in minimum.values())
        rows[label] = {"autotp": _bytes(split), "user loss_fn": _bytes(gathered), "megatron minimum": low,
                       "collectives": split, "ratio": _bytes(split) / low, "ratio user loss_fn": _bytes(gathered) / low}
    return rows


def table(rows: dict) -> str:
    """The results as a Markdown table."""
    mib = 2 ** 20
    lines = ["| model | Megatron minimum | autotp `pm.step` | ratio | with a user's `loss_fn` | ratio |",
             "|---|---|---|---|---|---|"]
    for label, r in rows.items():
        lines.append(f"| {label} | {r['megatron minimum'] / mib:.2f} MiB | {r['autotp'] / mib:.2f} MiB | "
                     f"{r['ratio']:.3f} | {r['user loss_fn'] / mib:.2f} MiB | {r['ratio user loss_fn']:.2f} |")
    return "\n".join(lines)


def main() -> None:
    """Measure, print the table, write ``bench/results/loss_parallel.json``."""
    rows = run_on_ranks(_measure, "cpu", [1, 1])[0]
    RESULTS.write_text(json.dumps(rows, indent=2) + "\n")
    print(table(rows))


if __name__ == "__main__":
    main()
