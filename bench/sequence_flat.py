"""Sequence parallelism on a model computing its projections on flattened tokens (GPT-2's ``Conv1D``).

    python -m bench.sequence_flat [--rounds 15]

``bench.sequence_parallel``'s measurement (two gloo CPU ranks, one thread each, tp=2, dropout 0.1, batch 4 x 128:
bytes each rank saves for backward in one forward, collectives of one ``pm.step`` counted at run time, step times
alternating) on transformers' ``GPT2LMHeadModel`` of the same shape (4 layers x 256, 8 heads, vocabulary 8192),
whose layers view ``[B, T, C]`` as ``[B*T, C]`` around each ``addmm``.
"""

from __future__ import annotations

from pathlib import Path

import torch

from bench.sequence_parallel import SHAPE, command, compare

RESULTS = Path(__file__).parent / "results" / "sequence_flat.json"


def _gpt2():
    import transformers

    config = transformers.GPT2Config(vocab_size=SHAPE.vocab_size, n_embd=SHAPE.n_embd, n_layer=SHAPE.n_layer,
                                     n_head=SHAPE.n_head, n_positions=SHAPE.seq, resid_pdrop=0.1, embd_pdrop=0.1,
                                     attn_pdrop=0.1)
    return transformers.GPT2LMHeadModel(config)


def _measure(rank: int, world: int, rounds: int) -> dict:
    torch.manual_seed(0)
    return compare(_gpt2(), f"GPT2LMHeadModel, {SHAPE.describe()}", world, rounds)


def main(argv=None) -> None:
    """Measure, print the table, write ``bench/results/sequence_flat.json``."""
    command(_measure, __doc__, RESULTS, argv)


if __name__ == "__main__":
    main()
