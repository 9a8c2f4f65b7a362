"""Context parallelism's ring and Ulysses exchanges for an explicit ``softmax(QK^T * scale + mask)V`` (transformers'
eager attention, hand-written decoders), found in the graph (``passes.attention_chains``): exact against the
unsharded model in the one-process checker and on gloo, the bytes each rank receives at the method's minimum, and
what stays with the all-gather."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import autotp
from autotp.capture import capture
from autotp.planning.context_plan import plan_context
from tests import context_workers, models
from tests.distributed import run_on_ranks


@pytest.mark.parametrize("name, batch, cp, method", [
    ("odd", None, 2, "ring"),  # masked_fill(mask == 0, -inf) of a causal buffer, scores * 0.25
    ("odd", None, 4, "ulysses"),
    ("llama_eager", "packed", 2, "ulysses"),  # repeat_kv (GQA) hoisted, packed documents' block-diagonal mask
])
def test_the_checker_simulates_an_explicit_attention_by_ring_and_ulysses(name, batch, cp, method):
    """(Eager Mistral by ring, whose padded rows' float mask hides every key, trains on gloo below.)"""
    model = context_workers.build(name) if name == "odd" else context_workers.HF[name]()
    example = context_workers.BATCHES[batch]() if batch else models.tokens(2, 16, 1)
    report = autotp.check(model, 1, example, cp=cp, cp_exchange=method)
    assert report.exact, str(report)


def test_the_explicit_chain_is_found_and_named_once():
    """Eager Llama: each layer's q @ k^T -> * scale -> + mask -> softmax -> dropout(p=0) -> @ v is one attention,
    its keys and values taken before repeat_kv; the plan names it by its product with V."""
    c = capture(context_workers.HF["llama_eager"](), (models.tokens(2, 16, 1),), training=True)
    layout = plan_context(c, 2, "ring")
    nodes = {n.name: n for n in c.module.graph.nodes}
    assert len(layout.explicit) == 2 and layout.exchanges == list(layout.explicit)
    for name, e in layout.explicit.items():
        assert layout.methods[name] == "ring" and e.scale == 0.25 and e.added and e.mask_op is not None
        heads = {x: nodes[getattr(e, x)].meta["val"].shape[1] for x in ("q", "k", "v")}
        assert heads == {"q": 4, "k": 2, "v": 2}, heads  # keys and values before repeat_kv: the KV heads


class _FiniteFill(nn.Module):
    """A decoder that masks its scores with a finite value (``masked_fill(~causal, -1e4)``): not what the ring's
    statistics compute, so the all-gather takes it."""

    def __init__(self):
        super().__init__()
        self.tok, self.qkv, self.head = nn.Embedding(models.VOCAB, 32), nn.Linear(32, 96), nn.Linear(32, models.VOCAB)

    def forward(self, ids):
        B, T = ids.shape
        q, k, v = (t.view(B, T, 2, 16).transpose(1, 2) for t in self.qkv(self.tok(ids)).split(32, -1))
        causal = torch.ones(T, T, dtype=torch.bool, device=ids.device).tril()
        att = (q @ k.transpose(-2, -1)).masked_fill(~causal, -1e4).softmax(-1)
        return self.head((att @ v).transpose(1, 2).reshape(B, T, 32))


def test_an_attention_no_method_takes_falls_back_to_all_gather_with_a_note():
    plan = autotp.plan(_FiniteFill(), example_inputs=models.tokens(2, 16, 0), cp=2, cp_exchange="ring")
    assert any("falls back to all-gather (ring cannot take it: not an SDPA or softmax" in n for n in plan.notes), \
        plan.notes
    report = autotp.check(_FiniteFill(), 1, models.tokens(2, 16, 1), cp=2, cp_exchange="ring")
    assert report.exact, str(report)


def test_explicit_attention_trains_exactly_on_gloo_and_moves_its_minimum():
    """Two ranks, one spawned group: eager Mistral (sliding window, left-padded batch) and eager GPT-2 (``Conv1D``'s
    merged ``[B*T, C]``, right-padded batch) by ring with the model's own loss, AdamW steps against the unsharded
    model; then eager Llama by Ulysses and GPT-2 by all-gather at 64 tokens: the bytes received equal
    ``exchange_cost``'s minimum, and less is saved for backward than one process saves."""
    cases = [("mistral_eager", "padded", "ring"), ("gpt2_eager", "padded", "ring")]
    moved = [("ulysses", "llama_eager"), ("all_gather", "gpt2")]
    for result in run_on_ranks(context_workers.exchange_suite, 2, cases, moved):
        for errors in result["errors"]:
            assert errors["output"] <= 1e-6 and errors["loss"] <= 1e-5 and errors["grad"] <= 1e-6, errors
        assert set(result["moved"]) == {"ulysses", "all_gather"}
        for method, got in result["moved"].items():
            assert got["received"] == got["minimum"], (method, got)
            assert got["cp"] < got["unsharded"], (method, got)


def test_a_trained_scale_is_refused_by_the_ring_and_ulysses():
    """A learnt temperature would get no gradient through the exchange's numeric scale: an InputError says to use
    the all-gather."""
    from autotp.rewrite.context_ops import trained_scale

    trained_scale(torch.tensor(0.25))  # a computed constant is taken
    with pytest.raises(autotp.InputError, match="cp_exchange='all_gather'"):
        trained_scale(torch.tensor(0.25, requires_grad=True))
