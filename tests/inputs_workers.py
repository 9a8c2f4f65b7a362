"""Per-rank bodies of the input tests on gloo: keyword inputs, padded batches, labels=, no example inputs.

Each compares the parallel model with the unsharded original, which every rank also builds: outputs, the
loss of every step, every gradient of the first step, and every parameter after AdamW steps.
"""

from __future__ import annotations

import torch
from torch.testing import assert_close
from torch.utils._pytree import tree_leaves

import autotp
from tests import models
from tests.workers import ADAM, STEPS

SEED = 7


def hf_llama() -> torch.nn.Module:
    """The tiny Llama of the issue (grouped-query attention: 4 heads, 2 KV heads)."""
    import transformers

    config = transformers.LlamaConfig(vocab_size=models.VOCAB, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    return transformers.LlamaForCausalLM(config)


def hf_gpt2() -> torch.nn.Module:
    """A tiny GPT-2 with its default dropouts (0.1), so padding meets dropout too."""
    import transformers

    return transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=models.VOCAB, n_embd=64, n_layer=2,
                                                                n_head=4, n_positions=64))


def padded_batch(side: str, batch: int = 4, seq: int = 12, seed: int = 1) -> dict[str, torch.Tensor]:
    """``input_ids``, ``attention_mask`` and ``labels`` of a batch padded on the ``side`` ('left' or 'right'):
    row i has i * 2 padding positions (masked, labelled -100, the pad id 0)."""
    ids = models.tokens(batch, seq, seed)
    mask = torch.ones_like(ids)
    for row in range(batch):
        pads = 2 * row
        if pads:
            mask[row, :pads] = 0 if side == "left" else 1
            mask[row, seq - pads:] = 1 if side == "left" else 0
    ids = ids.masked_fill(mask == 0, 0)
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


BUILDERS = {"hf_llama": hf_llama, "hf_gpt2": hf_gpt2}
CASES = [("hf_llama", "left"), ("hf_gpt2", "right")]


def _train_both(pm, ref, batch: dict) -> dict:
    """STEPS AdamW steps on ``pm`` and ``ref`` with the model's own loss (labels=); the largest errors."""
    pm.manual_seed(SEED)
    torch.manual_seed(SEED)
    opt, ref_opt = torch.optim.AdamW(pm.parameters(), **ADAM), torch.optim.AdamW(ref.parameters(), **ADAM)
    errors = {"loss": 0.0}
    for _ in range(STEPS):
        loss = pm.step(**batch)
        ref_loss = ref(**batch, use_cache=False).loss
        ref_loss.backward()
        assert_close(loss, ref_loss.detach(), rtol=1e-5, atol=1e-6)
        errors["loss"] = max(errors["loss"], float((loss - ref_loss.detach()).abs()))
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
    return errors


def _compare_state(pm, ref, label: str) -> float:
    """Every parameter and buffer of ``pm`` equals ``ref``'s; the largest error."""
    full, worst = pm.full_state_dict(), 0.0
    for key, want in ref.state_dict().items():
        assert_close(full[key], want, rtol=1e-5, atol=1e-5, msg=lambda m: f"{label} {key}: {m}")
        worst = max(worst, float((full[key].float() - want.float()).abs().max()))
    return worst


def keyword_training(rank: int, world: int) -> dict:
    """Padded batches fed by keyword (input_ids, attention_mask, labels) at tp=world: outputs, the model's own
    loss over 3 AdamW steps and every parameter afterwards equal the single-process model's."""
    out = {}
    for name, side in CASES:
        batch = padded_batch(side)
        torch.manual_seed(0)
        ref = BUILDERS[name]()
        pm = autotp.parallelize(ref, tp=world, example_inputs=batch)
        label = f"{name} ({side} padding)"
        pm.eval(), ref.eval()
        with torch.no_grad():
            want = ref(**batch, use_cache=False)
        got_kw, got_pos = pm(**batch), pm(batch["input_ids"], attention_mask=batch["attention_mask"],
                                                labels=batch["labels"])
        assert torch.isfinite(want.logits).all(), f"{label}: the reference itself is not finite"
        for got in (got_kw, got_pos):
            for g, w in zip(tree_leaves(got), tree_leaves(want)):
                assert_close(g, w, rtol=1e-5, atol=1e-6, msg=lambda m: f"{label} output: {m}")
        pm.train(), ref.train()
        errors = _train_both(pm, ref, batch)
        errors["params"] = _compare_state(pm, ref, label)
        out[label] = errors
    return out


def no_example_inputs(rank: int, world: int) -> dict:
    """``parallelize(model, tp=world)`` with no example inputs plans from synthesised token ids, says so, and
    computes what the model computes."""
    ref = models.build("gpt")
    pm = autotp.parallelize(ref, tp=world)
    x = models.tokens(3, 10, 5)  # sizes other than the synthesised ones: batch and sequence stay dynamic
    assert_close(pm(x), ref(x), rtol=1e-5, atol=1e-6)
    return {"notes": list(pm.plan.notes)}


def pipeline_keywords(rank: int, world: int) -> dict:
    """A pipeline (pp=world) takes its inputs by name too; labels= is refused with the reason and the fix."""
    ref = models.build("gpt")
    x, y = models.tokens(4, 8, 1), models.tokens(4, 8, 2)
    pm = autotp.parallelize(ref, tp=1, pp=world, example_inputs={"idx": x})
    assert_close(pm(idx=x), ref(x), rtol=1e-5, atol=1e-6)
    assert_close(pm.step(idx=x, target=y), models.loss_fn(ref(x), y), rtol=1e-5, atol=1e-6)
    try:
        pm.step(idx=x, labels=y)
    except autotp.InputError as e:
        return {"labels": str(e)}
    return {"labels": "no error"}


def inputs_on_ranks(rank: int, world: int) -> dict:
    """Every gloo check of this file in one spawned group, so start-up is paid once."""
    return {"keyword": keyword_training(rank, world), "synthesised": no_example_inputs(rank, world),
            "pipeline": pipeline_keywords(rank, world)}
