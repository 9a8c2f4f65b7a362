"""Per-rank bodies of the sequence-parallelism tests on gloo: padded Hugging Face batches with dropout on train
exactly with the residual stream split along the sequence, and each rank saves less for backward."""

from __future__ import annotations

import torch
from torch.testing import assert_close

import autotp
from bench.memory import SavedActivations
from examples.gpt import build_gpt
from tests import models
from tests.inputs_workers import BUILDERS, CASES, _compare_state, _train_both, padded_batch
from tests.dp_workers import check_data_parallel
from tests.workers import ADAM, STEPS


def padded_training(rank: int, world: int) -> dict:
    """Llama (left padding) and GPT-2 (right padding, dropout 0.1) by keyword with labels, sequence parallel:
    outputs, the model's own loss over AdamW steps and every parameter afterwards equal one process's."""
    out = {}
    for name, side in CASES:
        batch = padded_batch(side)
        torch.manual_seed(0)
        ref = BUILDERS[name]()
        pm = autotp.parallelize(ref, tp=world, example_inputs=batch, vocab="split", sequence_parallel=True)
        label = f"{name} ({side} padding)"
        pm.eval(), ref.eval()
        with torch.no_grad():
            assert_close(pm(**batch).logits, ref(**batch, use_cache=False).logits, rtol=1e-5, atol=1e-6)
        pm.train(), ref.train()
        errors = _train_both(pm, ref, batch)
        errors["params"] = _compare_state(pm, ref, label)
        out[label] = errors
    return out


def _saved_bytes(pm, x, y) -> int:
    """Bytes this rank saves for backward in one training step's forward (parameters excluded)."""
    saved = SavedActivations(list(pm.parameters()))
    with saved:
        loss = pm.loss(x, target=y)
    loss.backward()
    return saved.bytes


def activation_memory(rank: int, world: int) -> dict:
    """examples.gpt with dropout: the same losses with and without sequence parallelism, the bytes each rank
    saves for backward, and the error an odd sequence length gets."""
    torch.manual_seed(0)
    ref = build_gpt(n_layer=2, n_head=4, n_embd=64, vocab_size=models.VOCAB, block_size=64, dropout=0.1)
    x, y = models.tokens(2, 32, 1), models.tokens(2, 32, 2)
    result, losses = {}, {}
    for sequence_parallel in (False, True):
        pm = autotp.parallelize(ref, tp=world, example_inputs=x, vocab="split", sequence_parallel=sequence_parallel)
        pm.manual_seed(7)
        losses[sequence_parallel] = pm.step(x, target=y)
        result["sequence parallel" if sequence_parallel else "plain"] = _saved_bytes(pm, x, y)
    assert_close(losses[True], losses[False], rtol=1e-6, atol=1e-6)
    try:
        pm(models.tokens(2, 31, 3))
        result["odd"] = "no error"
    except autotp.InputError as e:
        result["odd"] = str(e)
    return result


def pipelined(rank: int, world: int, name: str = "hf_llama") -> dict:
    """tp=2 x pp=2, sequence parallel: every stage passes its sequence shards on; outputs, losses over AdamW
    steps and every parameter afterwards equal one process's (``name``: a ``models.build`` model of 4 layers)."""
    ref = models.build(name, layers=4)
    x, y = models.tokens(4, 12, seed=2), models.tokens(4, 12, seed=3)
    pm = autotp.parallelize(ref, tp=2, pp=world // 2, example_inputs=(models.tokens(2, 16, seed=1),), microbatches=2,
                            vocab="split", sequence_parallel=True)
    assert_close(pm(x).logits, ref(x).logits, rtol=1e-5, atol=1e-6)
    opt, ref_opt = torch.optim.AdamW(pm.parameters(), **ADAM), torch.optim.AdamW(ref.parameters(), **ADAM)
    for _ in range(STEPS):
        loss = pm.step(x, target=y, loss_fn=models.loss_fn)
        ref_loss = models.loss_fn(ref(x), y)
        ref_loss.backward()
        assert_close(loss, ref_loss.detach(), rtol=1e-5, atol=0)
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
    return {"params": _compare_state(pm, ref, "tp=2 x pp=2 sequence parallel"), "plan": pm.plan.sequence_parallel}


def on_four_ranks(rank: int, world: int) -> dict:
    """Sequence parallelism with the other two axes: pipelined, and with FSDP replicas."""
    return {"pipelined": pipelined(rank, world),
            "fsdp": check_data_parallel(2, 2, 1, "fsdp", sequence_parallel=True)}


def gpt2_pipelined(rank: int, world: int) -> dict:
    """``pipelined`` for GPT-2, whose layers compute on tokens flattened to ``[B*T, C]``."""
    return pipelined(rank, world, "hf_gpt2")


def sequence_parallel_on_ranks(rank: int, world: int) -> dict:
    """Every gloo check of the sequence-parallelism tests in one spawned group."""
    return {"padded": padded_training(rank, world), "memory": activation_memory(rank, world)}


def _train_at(pm, ref, x, y, opt, ref_opt) -> float:
    """One AdamW step of ``pm`` and ``ref`` on ``x`` (targets ``y``), the same dropout draws; the loss error."""
    pm.manual_seed(7), torch.manual_seed(7)
    loss = pm.step(x, target=y, loss_fn=models.loss_fn)
    ref_loss = models.loss_fn(ref(x), y)
    ref_loss.backward()
    opt.step(), ref_opt.step()
    opt.zero_grad(), ref_opt.zero_grad()
    return float((loss - ref_loss.detach()).abs())


def full_context_training(rank: int, world: int) -> dict:
    """Sequence parallel at full context: models whose causal-mask buffer and position table are as long as the
    example (``mask[:T, :T]`` and ``pos[:T]``; GPT-Neo's ``bias[:, :, k - q:k, :k]`` and ``arange(T)`` positions),
    captured at that length, with dropout: outputs and AdamW steps at full context and at a shorter length equal
    one process's, every parameter after; a longer sequence is refused with an autotp error. One model is
    captured at a shorter example and trained at full context too."""
    from tests.full_context_models import POSITIONS, OddLM, hf_model

    out = {}
    for label, build, example in (("param/2d", lambda: OddLM("param", "2d", dropout=0.1), POSITIONS),
                                  ("gpt_neo", lambda: hf_model("gpt_neo"), POSITIONS),
                                  ("param/2d captured short", lambda: OddLM("param", "2d", dropout=0.1), 8)):
        torch.manual_seed(0)
        ref = build()
        pm = autotp.parallelize(ref, tp=world, example_inputs=(models.tokens(2, example, 1),), vocab="split",
                                sequence_parallel=True)
        errors = {"plan": pm.plan.sequence_parallel, "loss": 0.0}
        opt, ref_opt = torch.optim.AdamW(pm.parameters(), **ADAM), torch.optim.AdamW(ref.parameters(), **ADAM)
        for seq in (POSITIONS, POSITIONS // 2):
            x, y = models.tokens(2, seq, 2), models.tokens(2, seq, 3)
            pm.eval(), ref.eval()
            with torch.no_grad():
                assert_close(models.first_tensor(pm(x)), models.first_tensor(ref(x)), rtol=1e-5, atol=1e-6)
            pm.train(), ref.train()
            for _ in range(STEPS):
                errors["loss"] = max(errors["loss"], _train_at(pm, ref, x, y, opt, ref_opt))
        errors["params"] = _compare_state(pm, ref, label)
        try:
            pm(models.tokens(2, POSITIONS + 2, 4))
            errors["longer"] = "no error"
        except autotp.AutotpError as e:
            errors["longer"] = f"{type(e).__name__}: {e}"
        out[label] = errors
    return out
