"""The read-only passes find Megatron's regions from graph structure alone."""

import pytest
import torch
from torch import nn

from autotp.capture import capture
from autotp.passes import find_embeddings, find_projections
from autotp.passes.graph import trainable_attrs
from autotp.passes.region_search import find_regions
from autotp.passes.vocab import find_vocab
from examples.llama import build_llama
from tests import models


def _analyse(model, tp=2, example=None):
    captured = capture(model, example if example is not None else (models.tokens(2, 16, 0),))
    graph = captured.graph
    projections, embeddings = find_projections(graph), find_embeddings(graph)
    vocab = find_vocab(graph, projections, embeddings)
    search = find_regions(graph, projections, embeddings, trainable_attrs(captured.module), tp,
                          skip=set(vocab.heads) if vocab else set())
    nodes = {n.name: n for n in graph.nodes}
    name = lambda node: captured.module_name(nodes[node])  # noqa: E731
    return captured, projections, vocab, search, name


@pytest.mark.parametrize("model_name, kinds", [
    ("gpt", ["attention", "mlp"]), ("llama", ["attention", "gated_mlp"]), ("hf_llama", ["attention", "gated_mlp"]),
    ("hf_gpt2", ["attention", "mlp"]), ("hf_bert", ["attention", "mlp"]), ("hf_qwen2", ["attention", "gated_mlp"]),
])
def test_regions_per_block(model_name, kinds):
    _, _, vocab, search, _ = _analyse(models.build(model_name))
    assert [r.kind for r in search.regions if r.kind != "row"] == kinds * 2
    assert all(len(r.rows) == 1 for r in search.regions)
    assert vocab is not None and len(vocab.embeddings) == 1


def test_fused_qkv_is_split_per_part():
    _, projections, _, search, name = _analyse(models.build("gpt"))
    attention = search.regions[0]
    assert name(attention.columns[0]) == "transformer.h.0.attn.c_attn"
    assert attention.segments == ((64, 64, 64),)


def test_gpt2_conv1d_weights_are_split_along_their_output_dim():
    _, projections, _, search, _ = _analyse(models.build("hf_gpt2"))
    column = projections[search.regions[0].columns[0]]
    assert (column.out_dim, column.in_features, column.out_features) == (1, 64, 192)


def test_tied_lm_head_is_found():
    _, projections, vocab, _, name = _analyse(models.build("gpt"))
    assert [name(h) for h in vocab.heads] == ["lm_head"]


def test_gqa_with_tp_above_the_kv_heads_shares_each_among_ranks():
    _, _, _, search, name = _analyse(models.build("llama"), tp=4)  # 4 query heads, 2 KV heads
    attention = search.regions[0]
    assert [name(c) for c in attention.columns] == ["layers.0.attention.wq", "layers.0.attention.wk",
                                                    "layers.0.attention.wv"]
    assert [(name(c), n) for c, n in attention.shared] == [("layers.0.attention.wk", 2), ("layers.0.attention.wv", 2)]
    assert not attention.replicated


def test_one_kv_head_at_tp4_is_kept_whole():
    torch.manual_seed(0)
    _, _, _, search, name = _analyse(build_llama(n_kv_heads=1), tp=4)  # nothing smaller than all of it to share
    assert not any(r.shared for r in search.regions)
    split = {name(c) for r in search.regions for c in r.columns}
    assert not split & {"layers.0.attention.wk", "layers.0.attention.wv"}


class _Obfuscated(nn.Module):
    """An MLP and an attention whose names say nothing: detection must use structure only."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(32, 96)
        self.b = nn.Linear(32, 32)
        self.c = nn.Linear(32, 128)
        self.d = nn.Linear(128, 32)

    def forward(self, x):
        bsz, t, _ = x.shape
        q, k, v = self.a(x).chunk(3, dim=-1)
        q, k, v = (z.reshape(bsz, t, 4, 8).permute(0, 2, 1, 3) for z in (q, k, v))
        att = torch.softmax(q @ k.transpose(-1, -2) / 8 ** 0.5, dim=-1) @ v
        x = x + self.b(att.permute(0, 2, 1, 3).reshape(bsz, t, 32))
        return x + self.d(torch.tanh(self.c(x)))


def test_detection_uses_structure_not_names():
    _, _, vocab, search, name = _analyse(_Obfuscated(), example=(torch.randn(2, 5, 32),))
    assert vocab is None
    assert [(r.kind, [name(c) for c in r.columns], [name(c) for c in r.rows]) for r in search.regions] == [
        ("attention", ["a"], ["b"]), ("mlp", ["c"], ["d"])]
    assert search.regions[0].segments == ((32, 32, 32),)


def test_projection_that_closes_nothing_is_split_alone_by_its_input():
    _, _, _, search, name = _analyse(models.build("hf_bert"))
    assert search.unmatched == []
    rows = [r for r in search.regions if r.kind == "row"]
    assert [tuple(name(n) for n in r.rows) for r in rows] == [("pooler.dense",)] and rows[0].columns == ()
