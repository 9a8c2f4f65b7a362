"""Context parallelism (cp): every sequence split across ranks for the whole model, attention exchanging keys
and values, found from the graph. Each model against the unsharded one on real gloo ranks: outputs, the loss,
every gradient and every parameter after AdamW steps; then the layout itself, and what is refused."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import autotp
from autotp.capture import capture
from autotp.planning.context_plan import plan_context
from autotp.rewrite.context_ops import rank_positions
from tests import capture_cache, context_workers, models
from tests.distributed import run_on_ranks


@pytest.fixture(scope="module")
def packed_llama():
    """The Llama on packed documents (cp=2 and cp=4 below) captured here once, not once per rank and run."""
    capture_cache.warm(context_workers.HF["llama"](), context_workers.BATCHES["packed"]())


@pytest.mark.parametrize("name", ["odd", "llama"])
def test_cp2_trains_exactly_with_a_loss_fn(name):
    """A hand-written decoder (a causal-mask buffer, a position table, explicit softmax(QK^T)V) and
    transformers' Llama (rotary from arange, grouped-query SDPA) at cp=2, trained with a cross-entropy loss_fn."""
    for errors in run_on_ranks(context_workers.train_against_unsharded, 2, name):
        assert errors["output"] <= 1e-6 and errors["loss"] <= 1e-6 and errors["grad"] <= 1e-6, errors


@pytest.mark.parametrize("name, batch", [("llama", "packed"), ("mistral", "padded"), ("gpt2", "padded")])
def test_cp2_trains_exactly_on_the_models_own_loss(name, batch, packed_llama):
    """Packed documents (position ids restarting: block-diagonal causal masks), Mistral's sliding window over a
    left-padded batch, GPT-2's learnt positions over a right-padded one; the model's own shifted loss."""
    for errors in run_on_ranks(context_workers.train_batch, 2, name, batch):
        assert errors["output"] <= 1e-6 and errors["loss"] <= 1e-5 and errors["grad"] <= 1e-6, errors


def test_cp4_trains_exactly(packed_llama):
    """Four ranks, each two of eight chunks of the packed batch."""
    for errors in run_on_ranks(context_workers.train_batch, 4, "llama", "packed"):
        assert errors["loss"] <= 1e-5 and errors["grad"] <= 1e-6, errors


def test_keys_and_values_move_at_the_all_gathers_minimum_and_less_is_saved():
    """Each rank receives exactly the other ranks' keys and values (KV heads, before repeat_kv) forward and their
    gradients' shares backward, and saves less for backward than one process does."""
    for result in run_on_ranks(context_workers.saved_and_moved, 2, 256):
        assert result["received"] == result["minimum"], result
        assert result["cp"] < result["unsharded"], result


def test_positions_are_two_chunks_per_rank_front_and_back():
    assert rank_positions(8, 2, 0) == [0, 1, 6, 7]
    assert rank_positions(8, 2, 1) == [2, 3, 4, 5]
    every = sorted(p for r in range(4) for p in rank_positions(16, 4, r))
    assert every == list(range(16))
    with pytest.raises(autotp.InputError, match="multiple of 4"):
        rank_positions(10, 2, 0)


def test_the_layout_splits_every_token_op_and_exchanges_only_at_attention():
    """Llama: every projection computes the rank's tokens; two attentions gather KV heads (before repeat_kv);
    rotary tables and the mask are read at the rank's positions; no op needs its input gathered otherwise."""
    c = capture(context_workers.llama(), (models.tokens(2, 16, 1),), training=True)
    layout = plan_context(c, 2)
    linears = [n.name for n in c.module.graph.nodes if n.target is torch.ops.aten.linear.default]
    assert linears and all(name in layout.split for name in linears)
    assert layout.attention == 2 and len(layout.kv) == 4 and not layout.crossing
    assert any(name.startswith("scaled_dot_product_attention") for name, _, _ in layout.selects)  # mask rows


class _DropoutLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok, self.up = nn.Embedding(models.VOCAB, 32), nn.Linear(32, models.VOCAB)
        self.drop = nn.Dropout(0.1)

    def forward(self, ids):
        return self.up(self.drop(self.tok(ids)))


def test_what_cannot_be_split_along_the_sequence_is_refused_at_plan_time_naming_the_op():
    with pytest.raises(autotp.PlanError, match="dropout.*draws random numbers per position"):
        autotp.plan(_DropoutLM().train(), 1, models.tokens(2, 8, 0), cp=2)


def test_generate_is_refused_with_the_reason_in_the_plan():
    plan = autotp.plan(context_workers.llama(), example_inputs=models.tokens(2, 16, 0), cp=2)  # tp: 1 with cp
    assert any("pm.generate is refused" in note for note in plan.notes)
    assert any("2 attention product(s) all-gather" in note for note in plan.notes)


@pytest.mark.parametrize("settings, match", [({"tp": 2, "sequence_parallel": True}, "sequence_parallel"),
                                             ({"compile": True}, "compile"), ({"cp": 0}, "cp"),
                                             ({"tp": 2, "dp": 2, "ep": 4}, "ep = tp only")])
def test_settings_cp_is_not_verified_with_are_refused(settings, match):
    with pytest.raises(autotp.InputError, match=match):
        autotp.Options(**{"cp": 2, **settings})


def test_the_cli_takes_cp(capsys):
    from autotp.tools.cli import build_parser, main, options_of

    args = build_parser().parse_args(["plan", "hf:llama", "--tp", "1", "--cp", "2"])
    assert options_of(args).cp == 2
    assert main(["plan", "hf:llama", "--cp", "2", "--seq", "32"]) == 0  # no --tp: 1 with cp
    assert "cp=2: every rank holds 2 of 4 sequence chunks" in capsys.readouterr().out


@pytest.mark.parametrize("name, cp", [("odd", 2), ("llama", 4)])
def test_the_checker_simulates_cp_ranks(name, cp):
    model = context_workers.build(name) if name == "odd" else context_workers.llama()
    report = autotp.check(model, 1, models.tokens(2, 16, 1), cp=cp)
    assert report.exact, str(report)


def test_the_checker_sees_a_rank_computing_the_wrong_tokens(monkeypatch):
    """Rank 1 told it holds rank 0's positions: its tokens' outputs are wrong, and the check says so. (The wrong
    rank may leave its peer waiting at a collective, so the simulated ranks wait 20 s here, not 120.)"""
    report = context_workers.wrong_positions_report(monkeypatch, tp=1, rank=1)
    assert not report.exact


def test_the_layout_search_picks_cp_at_128k_tokens_and_not_at_4k():
    """Four H100s: at 131072 tokens (batch 1) activations dominate and cp divides them without tp's per-layer
    all-reduces or a pipeline's bubble; at 4096 tokens (batch 8) data parallelism divides the same compute with
    no K/V exchange. Every cp layout offered is one parallelize runs."""
    from autotp.capture import capture_repeated
    from autotp.planning.layout_search import runs, search_layouts
    from autotp.planning.machines import MACHINES

    captured = capture_repeated(context_workers.llama(), models.tokens(2, 16, 0))
    long = search_layouts(captured, 4, autotp.Options(seq=131072, batch=1), {}, MACHINES["h100"])
    short = search_layouts(captured, 4, autotp.Options(seq=4096, batch=8), {}, MACHINES["h100"])
    assert long.chosen.layout.cp > 1 and long.options.cp == long.chosen.layout.cp, long.chosen
    assert long.chosen.cp_comm > 0 and long.chosen.fits
    assert short.chosen.layout.cp == 1, short.chosen
    assert any(p.layout.cp > 1 for p in short.ranked)  # considered, and ranked below
    assert all(runs(p.layout) for p in (*long.ranked, *short.ranked))


def test_cp_is_a_fixed_setting_of_the_search():
    from autotp.tools.cli import build_parser
    from autotp.tools.planned import searched_settings

    args = build_parser().parse_args(["plan", "hf:llama", "--devices", "4", "--cp", "2"])
    assert searched_settings(args)["cp"] == 2
    assert autotp.planning.layout_search.fixed_settings({"cp": 2, "tp": None}, None) == {"cp": 2}
    with pytest.raises(autotp.InputError, match="cp must be a positive integer"):
        autotp.planning.layout_search.fixed_settings({"cp": 0}, None)
