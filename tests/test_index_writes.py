"""Writes at indices of a split value (``index_put``): along the split dim each rank writes the indices within its
chunk (Chameleon suppresses its image tokens in vocabulary-split logits); along another dim, its slice."""

from __future__ import annotations

import torch
from torch import nn

import autotp
from tests.distributed import run_on_ranks
from tests.workers import assert_trains_like

VOCAB = 512


class _SuppressedTokens(nn.Module):
    """An LM whose logits get the smallest value at some token ids (one negative, one repeated), written in place
    through full slices, as Chameleon writes ``logits[:, :, image_tokens] = finfo.min``."""

    def __init__(self, dim: int = 64):
        super().__init__()
        self.embed, self.head = nn.Embedding(VOCAB, dim), nn.Linear(dim, VOCAB)
        self.up, self.down = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)
        self.register_buffer("banned", torch.tensor([3, 300, -1, 257, 3]), persistent=False)

    def forward(self, ids):
        x = self.embed(ids)
        logits = self.head(x + self.down(torch.relu(self.up(x))))
        logits[:, :, self.banned] = torch.finfo(logits.dtype).min
        return logits


class _MaskedPositions(_SuppressedTokens):
    """The same logits with the first position of every sequence written whole (an index along the batch and
    the sequence, not the split vocabulary)."""

    def forward(self, ids):
        x = self.embed(ids)
        logits = self.head(x + self.down(torch.relu(self.up(x))))
        rows = torch.arange(ids.shape[0])
        logits[rows, torch.zeros_like(rows)] = 0.0
        return logits


def _ids(batch: int = 2, seq: int = 8, seed: int = 1):
    return (torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed)),)


def test_writes_at_token_ids_of_split_logits_are_each_rank_s_own_and_exact():
    for cls in (_SuppressedTokens, _MaskedPositions):
        for tp in (2, 4):
            torch.manual_seed(0)
            report = autotp.check(cls(), tp, _ids(), vocab="split")
            assert report.exact, report
            assert report.plan.placements["head.weight"].is_split, (cls.__name__, report.plan.placements)


def _trained(rank: int, world: int) -> None:
    torch.manual_seed(0)
    ref = _SuppressedTokens()
    pm = autotp.parallelize(ref, tp=world, example_inputs=_ids(), vocab="split")
    x, y = _ids(4, 12, seed=2)[0], _ids(4, 12, seed=3)[0]
    torch.testing.assert_close(pm(x), ref(x), rtol=1e-5, atol=1e-5)
    assert_trains_like(pm, ref, x, y)


def test_suppressed_tokens_train_exactly_on_two_ranks():
    run_on_ranks(_trained, 2)
