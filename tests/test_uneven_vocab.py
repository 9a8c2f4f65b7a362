"""A vocabulary tp does not divide is split unevenly (the first V % tp ranks hold one row more, as
``torch.tensor_split`` cuts): the embedding, the head (tied or not), the vocab-parallel loss and the logits' gather
stay exact, and the logits keep the vocabulary's size. Where the split reaches a value that would need equal
chunks (a mean over the vocabulary, a reshape merging it), the vocabulary is kept whole."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import autotp
from autotp.passes.placement import Placement, PlacementKind, chunk_span, full_tensor, local_shard
from autotp.passes.steps import Operator
from tests import models

VOCAB = 81


@pytest.mark.parametrize("size, tp", [(81, 2), (81, 4), (10, 4), (64, 4)])
def test_chunks_are_cut_as_tensor_split(size, tp):
    parts = torch.arange(size).tensor_split(tp)
    assert [chunk_span(size, tp, r) for r in range(tp)] == [(int(p[0]), len(p)) for p in parts]


def test_uneven_shards_put_back_together():
    full = torch.randn(VOCAB, 8)
    placement = Placement(PlacementKind.VOCAB, 0)
    shards = [placement.part(tuple(full.shape), r, 4).take(full) for r in range(4)]
    assert [s.shape[0] for s in shards] == [21, 20, 20, 20]
    assert torch.equal(full_tensor(placement, shards), full)
    assert all(torch.equal(local_shard(full, 0, (), r, 4), s) for r, s in enumerate(shards))


def _split_unevenly(plan, head: str) -> None:
    assert plan.placements[head].kind is PlacementKind.VOCAB, plan.placements
    assert any("split unevenly" in n for n in plan.notes), plan.notes


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("tied", [True, False])
def test_an_odd_vocabulary_is_split_and_exact(tied, tp):
    torch.manual_seed(0)
    pad = VOCAB - 1  # the padding row among the last rank's rows, at its own offset
    report = autotp.check(models.PaddedLM(tied, vocab=VOCAB, pad=pad), tp=tp, vocab="split",
                          example_inputs=(models.padded_ids(pad, VOCAB),))
    assert report.exact, str(report)
    _split_unevenly(report.plan, "head.weight")
    assert report.compared >= 2 * 6 + 2  # output, loss, every gradient and every parameter after a step


_GPT2 = dict(n_embd=32, n_layer=1, n_head=4)
_LLAMA = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
              tie_word_embeddings=False)


@pytest.mark.parametrize("name, config, tp", [("GPT2LMHeadModel", _GPT2, 2), ("GPT2LMHeadModel", _GPT2, 4),
                                              ("LlamaForCausalLM", _LLAMA, 4)])
def test_hugging_face_models_own_loss_on_an_odd_vocabulary(name, config, tp):
    """GPT-2's tied head and Llama's untied one, with ``labels``: the model's loss flattens the logits to
    ``[-1, vocab]`` (each rank's own width) and runs as the vocab-parallel cross-entropy on the shards."""
    torch.manual_seed(0)
    kind = "GPT2Config" if name.startswith("GPT2") else "LlamaConfig"
    model = models._hf(kind, name, vocab_size=VOCAB, bos_token_id=0, eos_token_id=0, pad_token_id=0, **config)
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    report = autotp.check(model, tp=tp, vocab="split", example_inputs={"input_ids": ids, "labels": ids})
    assert report.exact, str(report)
    _split_unevenly(report.plan, "lm_head.weight")
    assert Operator.CROSS_ENTROPY in {c.operator for c in report.plan.collectives}


class _Reads(nn.Module):
    """A head whose logits are read in ways that need equal chunks: centred by their mean over the vocabulary, or
    interleaved with their negatives (``[B, T, V, 2] -> [B, T, 2 * V]``, whose 162 tp=2 divides, though 41 + 40
    rows cut it at 82)."""

    def __init__(self, read: str):
        super().__init__()
        self.read = read
        self.embed, self.head = nn.Embedding(VOCAB, 16), nn.Linear(16, VOCAB)

    def forward(self, ids):
        logits = self.head(torch.tanh(self.embed(ids)))
        if self.read == "centred":
            return logits - logits.mean(-1, keepdim=True)
        return torch.stack((logits, -logits), -1).flatten(2)


@pytest.mark.parametrize("read", ["centred", "interleaved"])
def test_reads_needing_equal_chunks_keep_the_vocabulary_whole(read):
    torch.manual_seed(0)
    ids = torch.randint(0, VOCAB, (2, 6), generator=torch.Generator().manual_seed(2))
    report = autotp.check(_Reads(read), tp=2, vocab="split", example_inputs=(ids,))
    assert report.exact, str(report)
    head = report.plan.placements.get("head.weight")
    assert head is None or not head.is_split, head
    assert any("cut unevenly" in n for n in report.plan.notes), report.plan.notes
