"""Context parallelism's exchange methods: the ring (key/value blocks around the cp ranks, merged by running
softmax statistics) and Ulysses (all-to-all between sequence and heads) against torch's SDPA on simulated ranks,
each method training models exactly on gloo at cp=2 and cp=4 with the bytes it moves counted at its minimum, the
cost model's prices and choice, and how the plan and the command line say which method each attention takes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import autotp
from autotp.options import ContextExchange
from autotp.planning.context_exchange import AttentionShape, applicable, choose_exchange, exchange_cost
from autotp.rewrite.context_ops import Positions, rank_positions
from autotp.rewrite.context_ring import RingAttention
from autotp.rewrite.context_ulysses import UlyssesAttention
from tests import context_workers, models
from tests.distributed import on_threads, run_on_ranks

B, H, KV, T, D = 2, 4, 2, 16, 8


def _masks() -> dict:
    """Every mask form an attention meets: none, causal (``is_causal``), a boolean one with rows that see no key
    (padding), a float one (transformers': large negatives, some rows masked whole), one per head."""
    torch.manual_seed(3)
    causal = torch.ones(T, T).tril().bool()
    pad = causal[None, None].repeat(B, 1, 1, 1)
    pad[1, :, :, :5] = False  # row 1 left-padded: its first five queries see nothing
    floating = torch.zeros(B, 1, T, T).masked_fill(~pad, torch.finfo(torch.float32).min)
    window = causal & ~torch.ones(T, T).tril(-4).bool()
    return {"none": (None, False), "causal": (None, True), "bool-padded": (pad, False),
            "float-padded": (floating, False), "window-per-head": (window.expand(1, H, T, T).clone(), False)}


@pytest.mark.parametrize("method", ["ring", "ulysses"])
@pytest.mark.parametrize("cp", [2, 4])
def test_the_exchange_equals_sdpa_forward_and_backward(method, cp):
    """Each rank's output rows and its queries', keys' and values' gradients equal SDPA's on the whole sequence,
    grouped-query attention included (KV heads exchanged before their repeat)."""
    kv_heads = KV if method == "ring" or KV % cp == 0 else H  # Ulysses at cp=4 needs 4 KV heads
    for label, (mask, causal) in _masks().items():
        q, k, v, grad = (torch.randn(B, h, T, D) for h in (H, kv_heads, kv_heads, H))
        for x in (q, k, v):
            x.requires_grad_(True)
        n_rep = H // kv_heads
        want = F.scaled_dot_product_attention(q, k.repeat_interleave(n_rep, 1), v.repeat_interleave(n_rep, 1),
                                              attn_mask=mask, is_causal=causal)
        want.backward(grad)

        def rank(comm):
            pos = torch.tensor(rank_positions(T, cp, comm.rank))
            local = [x.detach().index_select(2, pos).requires_grad_(True) for x in (q, k, v)]
            kind = RingAttention if method == "ring" else UlyssesAttention
            module = kind(comm, Positions(cp, comm.rank), causal, None, n_rep)
            rows = mask.index_select(-2, pos) if mask is not None and method == "ring" else mask
            out = module(*local, rows, T)
            out.backward(grad.index_select(2, pos))
            return pos, out.detach(), [x.grad for x in local]

        for pos, out, grads in on_threads(cp, rank):
            torch.testing.assert_close(out, want.detach().index_select(2, pos), rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"{label}: {m}")
            for got, x in zip(grads, (q, k, v)):
                torch.testing.assert_close(got, x.grad.index_select(2, pos), rtol=1e-5, atol=1e-6,
                                           msg=lambda m: f"{label} grad: {m}")


def test_each_exchange_trains_exactly_at_cp2_and_moves_its_minimum():
    """Mistral's sliding window over a left-padded batch by ring, packed documents on Llama (rotary, GQA) by
    Ulysses; then the bytes the ring received, at its minimum, and less saved for backward than unsharded."""
    cases = [("mistral", "padded", "ring"), ("llama", "packed", "ulysses")]
    for result in run_on_ranks(context_workers.exchange_suite, 2, cases, [("ring", "llama")]):
        for errors in result["errors"]:
            assert errors["output"] <= 1e-6 and errors["loss"] <= 1e-5 and errors["grad"] <= 1e-6, errors
        for method, got in result["moved"].items():
            assert got["received"] == got["minimum"], (method, got)
            assert got["cp"] < got["unsharded"], (method, got)


@pytest.mark.slow
def test_more_exchanges_train_exactly_at_cp2():
    """Llama by ring with a loss_fn, Mistral by Ulysses; the bytes Ulysses received, at its minimum."""
    cases = [("llama", None, "ring"), ("mistral", "padded", "ulysses")]
    for result in run_on_ranks(context_workers.exchange_suite, 2, cases, [("ulysses", "llama")]):
        for errors in result["errors"]:
            assert errors["loss"] <= 1e-5 and errors["grad"] <= 1e-6, errors
        for method, got in result["moved"].items():
            assert got["received"] == got["minimum"], (method, got)


@pytest.mark.slow
def test_each_exchange_trains_exactly_at_cp4():
    """Four ranks: Mistral over a padded batch by ring, packed documents on a Llama of 4 KV heads by Ulysses."""
    cases = [("mistral", "padded", "ring"), ("llama4", "packed", "ulysses")]
    moved = [("ring", "llama"), ("ulysses", "llama4")]
    for result in run_on_ranks(context_workers.exchange_suite, 4, cases, moved):
        for errors in result["errors"]:
            assert errors["loss"] <= 1e-5 and errors["grad"] <= 1e-6, errors
        for method, got in result["moved"].items():
            assert got["received"] == got["minimum"], (method, got)


@pytest.mark.parametrize("name, cp, method", [("llama", 2, "ring"), ("llama", 2, "ulysses")])
def test_the_checker_simulates_each_exchange(name, cp, method):
    model = context_workers.llama()
    report = autotp.check(model, 1, context_workers.packed(), cp=cp, cp_exchange=method)
    assert report.exact, str(report)


def test_ulysses_cannot_take_an_attention_whose_kv_heads_cp_does_not_divide():
    """(An attention no method but the all-gather takes: ``tests/test_context_explicit.py``.)"""
    gqa = AttentionShape(1, 16, 4, 2, 16)
    assert applicable(ContextExchange.ULYSSES, gqa, 4) == "cp=4 does not divide its 2 KV heads"
    assert applicable(ContextExchange.ULYSSES, gqa, 2) is None


def test_the_plan_names_each_attentions_method():
    plan = autotp.plan(context_workers.llama(), example_inputs=models.tokens(2, 16, 0), cp=2, cp_exchange="ring")
    assert any("scaled_dot_product_attention by ring, scaled_dot_product_attention_1 by ring" in n
               for n in plan.notes), plan.notes


SHAPE = AttentionShape(batch=1, seq=8192, heads=32, kv_heads=8, head_dim=128, itemsize=2)


def test_exchange_cost_prices_each_method():
    """Per rank and training step, one attention of a Llama 3 8B layer at 8192 tokens, cp=4 (bf16)."""
    kv = 8192 * 8 * 128 * 2  # one whole K, bytes
    gather, ring, ulysses = (exchange_cost(m, SHAPE, 4) for m in ("all_gather", "ring", "ulysses"))
    assert gather.received == 2 * 2 * kv * 3 // 4 and ring.received == 3 * 2 * kv * 3 // 4
    assert ulysses.received == 2 * 2 * (32 + 8) * 128 * 2 * 2048 * 3 // 4
    assert gather.held == 2 * kv * (1 + 4)  # whole K and V, and their repeat to the query heads
    assert ring.held == 2 * 2 * kv // 4 and ring.messages == 9


def test_auto_gathers_while_keys_fit_and_leaves_the_all_gather_when_they_do_not():
    small = AttentionShape(1, 64, 4, 2, 16)
    assert choose_exchange([small, None], 2) == ["all_gather", "all_gather"]
    assert choose_exchange([SHAPE] * 8, 4) == ["ulysses"] * 8  # 8 layers' whole K/V: over HOLD_LIMIT
    assert choose_exchange([SHAPE] * 32, 4) == ["ring"] * 32  # and Ulysses' heads of 32 layers too
    assert choose_exchange([SHAPE], 16) == ["all_gather"]
    assert choose_exchange([SHAPE], 16, memory_budget=2 ** 20) == ["ring"]  # 16 does not divide 8 KV heads
    masked = AttentionShape(1, 65536, 32, 8, 128, 2, masked=True)  # Ulysses would hold a 16 GiB mask whole
    assert choose_exchange([masked] * 32, 8, memory_budget=80 * 2 ** 30) == ["ring"] * 32


def test_the_setting_and_its_command_line_flag():
    from autotp.tools.cli import build_parser, options_of

    args = build_parser().parse_args(["plan", "hf:llama", "--cp", "2", "--cp-exchange", "ulysses"])
    assert options_of(args).cp_exchange is ContextExchange.ULYSSES
    with pytest.raises(autotp.InputError, match="cp_exchange"):
        autotp.Options(cp=2, cp_exchange="rings")
