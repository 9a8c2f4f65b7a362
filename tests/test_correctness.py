"""Never silently wrong: exact randomness, modes, weights from one source, padding rows, clear errors."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import autotp
from tests import correctness_workers, models
from tests.distributed import run_on_ranks

X = models.tokens(2, 16, 0)


def test_dropout_trains_exactly_like_one_process_whatever_the_ranks_generators():
    results = run_on_ranks(correctness_workers.dropout_training, 2)
    for name, r in results[0].items():
        assert r["worst"] < 1e-5, name
        assert r["losses"] == results[1][name]["losses"], name


def test_modes_weights_and_padding_rows():
    results = run_on_ranks(correctness_workers.modes_and_weights, 2)
    assert results[0]["padded"] == {"True": True, "False": True, "81": True}
    assert results[0]["default_group_held"] is False  # torch's default group is held by name only


def test_a_stopped_rank_gives_the_others_a_clear_error():
    results = run_on_ranks(correctness_workers.peer_failure, 2)
    assert results[1] == "stopped"
    # The peer that stopped is named (its call count from the c10d store), with the raw cause kept.
    assert results[0].startswith("rank 0: forward #1 could not finish: rank 1 (it began 0 of these calls) stopped or "
                                 "hangs before call #1"), results[0]


@pytest.fixture(scope="module")
def single():
    torch.manual_seed(0)
    return autotp.parallelize(models.build("gpt"), tp=1, vocab="split", example_inputs=(X,))


def test_inputs_longer_than_the_capture_allows(single):
    with pytest.raises(autotp.InputError, match="outside what the model was captured for"):
        single(models.tokens(2, 200, 0))


def test_float_token_ids_and_keyword_inputs(single):
    with pytest.raises(autotp.InputError, match="captured with a 2-d torch.int64"):
        single(X.float())
    with pytest.raises(autotp.InputError, match="input_ids=, which the model's forward does not take; it takes idx"):
        single(input_ids=X)
    assert torch.equal(single(idx=X), single(X))  # an input passed by its name is the same input


@pytest.mark.parametrize("loss_fn, message", [
    (lambda out, y: out.sum(-1), "must return a scalar tensor"),
    (lambda out, y: 1.5, "must return a scalar tensor.*got float"),
    (lambda out, y: out.sum().detach(), "no gradient history"),
])
def test_bad_loss_functions(single, loss_fn, message):
    with pytest.raises(autotp.InputError, match=message):
        single.step(X, target=X, loss_fn=loss_fn)


def test_meta_models_are_refused_before_anything_runs():
    with torch.device("meta"):
        model = models.build("gpt")
    with pytest.raises(autotp.InputError, match="on the meta device"):
        autotp.parallelize(model, tp=1, vocab="split", example_inputs=(X,))


class _WithExtraState(nn.Module):
    """A module whose state dict holds a ``None`` entry (megatron-core's ``_extra_state``)."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def get_extra_state(self):
        return None

    def set_extra_state(self, state):
        pass

    def forward(self, x):
        return self.proj(x)


def test_none_entries_in_the_state_dict():
    pm = autotp.parallelize(_WithExtraState(), tp=1, vocab="split", example_inputs=(torch.randn(2, 3, 8),))
    full = pm.full_state_dict()
    assert "_extra_state" in full and full["_extra_state"] is None


def test_a_plan_naming_a_dim_the_weight_lacks_is_refused():
    model = models.build("gpt")
    plan = autotp.plan(model, tp=2, vocab="split", example_inputs=(X,))
    bad = dict(plan.placements) | {"transformer.ln_f.weight": autotp.Placement("colwise", 3)}
    with pytest.raises(autotp.PlanError, match="transformer.ln_f.weight.*dim 3"):
        autotp.check(model, tp=2, vocab="split", example_inputs=(X,), plan=plan.replace(placements=bad))


def test_a_hand_edited_plan_with_swapped_projections_is_exact_or_refused():
    model = models.build("gpt")
    plan = autotp.plan(model, tp=2, vocab="split", example_inputs=(X,))
    swapped = dict(plan.placements)
    swapped["transformer.h.0.mlp.c_fc.weight"] = autotp.Placement("rowwise", 1)
    swapped["transformer.h.0.mlp.c_fc.bias"] = autotp.Placement("replicated")
    swapped["transformer.h.0.mlp.c_proj.weight"] = autotp.Placement("colwise", 0)
    swapped["transformer.h.0.mlp.c_proj.bias"] = autotp.Placement("colwise", 0)
    try:
        report = autotp.check(model, tp=2, vocab="split", example_inputs=(X,), plan=plan.replace(placements=swapped))
    except autotp.PlanError as e:
        assert "c_fc" in str(e) or "c_proj" in str(e)
    else:
        assert report.exact, str(report)


class _FusedMQA(nn.Module):
    """Multi-query attention in one fused projection: Q of 4 heads, then one K head and one V head."""

    def __init__(self, dim: int = 64, heads: int = 4):
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.qkv = nn.Linear(dim, dim + 2 * self.head_dim)
        self.out = nn.Linear(dim, dim)
        self.up, self.down = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).split([d, self.head_dim, self.head_dim], dim=-1)
        q = q.view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k, v = (z.view(b, t, 1, self.head_dim).transpose(1, 2).expand(b, self.heads, t, self.head_dim) for z in (k, v))
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(y.transpose(1, 2).reshape(b, t, d))
        return x + self.down(torch.relu(self.up(x)))


@pytest.mark.parametrize("tp", [2, 4])
def test_fused_multi_query_attention_runs_exactly(tp):
    """Its K/V segments (one head) cannot be column-split: the attention is computed whole, its projections split
    alone by their input features, with a note; the MLP splits."""
    torch.manual_seed(0)
    model, x = _FusedMQA(), torch.randn(2, 8, 64)
    plan = autotp.plan(model, tp=tp, vocab="split", example_inputs=(x,))
    assert plan.placements["qkv.weight"].kind.value == "rowwise" and plan.placements["up.weight"].kind.value == "colwise"
    assert any(n.startswith("qkv split alone") and "scaled_dot_product_attention" in n for n in plan.notes), plan.notes
    assert autotp.check(model, tp=tp, vocab="split", example_inputs=(x,)).exact


class _Renormed(nn.Module):
    """A language model whose embedding renormalises rows in place (``max_norm``) or scales by frequency."""

    def __init__(self, **embedding):
        super().__init__()
        self.embed = nn.Embedding(64, 32, **embedding)
        self.up, self.down = nn.Linear(32, 128), nn.Linear(128, 32)
        self.head = nn.Linear(32, 64)

    def forward(self, ids):
        x = self.embed(ids)
        return self.head(x + self.down(torch.relu(self.up(x))))


@pytest.mark.parametrize("option, said", [({"max_norm": 1.0}, "writes in place"),
                                          ({"scale_grad_by_freq": True}, "scale_grad_by_freq=True")])
def test_embedding_options_a_vocabulary_split_cannot_honour_keep_it_whole(option, said):
    torch.manual_seed(0)
    model, ids = _Renormed(**option), models.padded_ids()
    plan = autotp.plan(model, tp=2, vocab="split", example_inputs=(ids,))
    assert not plan.placements["embed.weight"].is_split and plan.placements["up.weight"].is_split
    assert any(said in n for n in plan.notes), plan.notes
    assert autotp.check(model, tp=2, vocab="split", example_inputs=(ids,)).exact


class _Codebooks(nn.Module):
    """Three codebooks of 32 codes in one table and one head (as Dia's audio decoder): the head's 96 logits are
    viewed as [3 codebooks, 32 codes], so a vocabulary split in two would end a rank's rows inside a codebook."""

    def __init__(self, books: int = 3, codes: int = 32, width: int = 32):
        super().__init__()
        self.books, self.codes = books, codes
        self.embed = nn.Embedding(books * codes, width)
        self.register_buffer("offsets", torch.arange(books) * codes, persistent=False)
        self.up, self.down = nn.Linear(width, 128), nn.Linear(128, width)
        self.head = nn.Linear(width, books * codes, bias=False)

    def forward(self, ids):  # ids: [B, T, books]
        b, t, _ = ids.shape
        x = self.embed(ids + self.offsets).sum(dim=2)
        x = x + self.down(torch.relu(self.up(x)))
        return self.head(x).view(b, t, self.books, self.codes).transpose(1, 2).reshape(b * self.books, t, self.codes)


def test_a_vocabulary_split_that_would_cut_inside_a_codebook_keeps_it_whole():
    torch.manual_seed(0)
    model, ids = _Codebooks(), torch.randint(0, 32, (2, 8, 3))
    plan = autotp.plan(model, tp=2, vocab="split", example_inputs=(ids,))
    assert not plan.placements["head.weight"].is_split and plan.placements["up.weight"].is_split
    assert any("which tp=2 does not divide" in n for n in plan.notes), plan.notes
    assert autotp.check(model, tp=2, vocab="split", example_inputs=(ids,)).exact
