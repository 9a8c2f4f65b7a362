"""Per-rank bodies of the context-parallelism tests on gloo: each rank computes its own chunks of every sequence,
and outputs, losses, gradients and parameters after AdamW steps equal the unsharded model's."""

from __future__ import annotations

import torch
from torch.testing import assert_close

import autotp
from tests import models
from tests.full_context_models import OddLM, hf_model
from tests.workers import ADAM, STEPS


def build(name: str) -> torch.nn.Module:
    """A small model of ``name``: ``odd`` (hand-written, a causal-mask buffer and a position table), or one of
    ``full_context_models.hf_model``'s Hugging Face decoders."""
    torch.manual_seed(0)
    return OddLM() if name == "odd" else hf_model(name)


def _logits(out) -> torch.Tensor:
    return models.first_tensor(out)


def _grads(pm) -> dict[str, torch.Tensor]:
    """Every parameter's gradient under its original name (a cp rank holds every parameter whole)."""
    out = {}
    for module in pm.rank_modules():
        for name, param in pm._names.params(module).items():
            if param.grad is not None:
                out[name] = param.grad
    return out


def train_against_unsharded(rank: int, world: int, name: str, seq: int = 16, exchange: str = "auto") -> dict:
    """cp=world: eval outputs, then STEPS AdamW steps of cross-entropy (the loss, every gradient, every parameter
    afterwards) equal the unsharded model's; returns the largest errors."""
    ref = llama4() if name == "llama4" else build(name)
    x, y = models.tokens(2, seq, 1), models.tokens(2, seq, 2)
    pm = autotp.parallelize(ref, cp=world, tp=1, example_inputs=x, cp_exchange=exchange)
    _check_exchange(pm, exchange)
    pm.eval(), ref.eval()
    with torch.no_grad():
        got, want = _logits(pm(x)), _logits(ref(x))
    assert_close(got, want, rtol=1e-5, atol=1e-6)
    errors = {"output": float((got - want).abs().max()), "loss": 0.0, "grad": 0.0}
    pm.train(), ref.train()
    opt, ref_opt = torch.optim.AdamW(pm.parameters(), **ADAM), torch.optim.AdamW(ref.parameters(), **ADAM)
    for _ in range(STEPS):
        loss = pm.step(x, target=y, loss_fn=models.loss_fn)
        ref_loss = models.loss_fn(ref(x), y)
        ref_loss.backward()
        assert_close(loss, ref_loss.detach(), rtol=1e-5, atol=1e-6)
        errors["loss"] = max(errors["loss"], float((loss - ref_loss.detach()).abs()))
        errors["grad"] = max(errors["grad"], _check_grads(pm, ref, name))
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
    _check_params(pm, ref, name)
    try:
        pm.generate(x, max_new_tokens=2)
    except autotp.InputError as e:
        assert "context-parallel" in str(e), e
    else:
        raise AssertionError("generate on a cp module ran")
    return errors


def _check_grads(pm, ref, label: str) -> float:
    """Every gradient of ``pm`` equals ``ref``'s; the largest error."""
    grads, worst = _grads(pm), 0.0
    for key, p in ref.named_parameters():
        g = grads.get(key)
        assert g is not None, f"{label}: no gradient for {key}"
        assert_close(g, p.grad, rtol=1e-4, atol=1e-6, msg=lambda m: f"{label} grad {key}: {m}")
        worst = max(worst, float((g - p.grad).abs().max()))
    return worst


def _check_params(pm, ref, label: str) -> None:
    """Every parameter and buffer of ``pm`` equals ``ref``'s."""
    full = pm.full_state_dict()
    for key, want in ref.state_dict().items():
        assert_close(full[key], want, rtol=1e-5, atol=1e-5, msg=lambda m: f"{label} {key}: {m}")


def mistral() -> torch.nn.Module:
    """A tiny Mistral whose sliding window (4) is shorter than the sequence, so the window masks keys."""
    import transformers

    torch.manual_seed(0)
    config = transformers.MistralConfig(vocab_size=models.VOCAB, hidden_size=64, intermediate_size=128,
                                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                        sliding_window=4)
    return transformers.MistralForCausalLM(config)


def gpt2() -> torch.nn.Module:
    """A tiny GPT-2 (a learnt position table read with ``arange``), dropout off: dropout draws per position."""
    import transformers

    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=models.VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0))


def llama() -> torch.nn.Module:
    """A tiny Llama (rotary from ``arange``, grouped-query attention: 4 heads, 2 KV heads)."""
    torch.manual_seed(0)
    return _llama()


def _llama() -> torch.nn.Module:
    import transformers

    config = transformers.LlamaConfig(vocab_size=models.VOCAB, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    return transformers.LlamaForCausalLM(config)


def llama4() -> torch.nn.Module:
    """A tiny Llama of 8 query and 4 KV heads (head dim 8), so that Ulysses runs at cp=4."""
    import transformers

    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=models.VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=4))


def eager(build):
    """``build``'s model on transformers' eager attention: an explicit ``softmax(QK^T * scale + mask)V``."""
    def built() -> torch.nn.Module:
        model = build()
        model.config._attn_implementation = "eager"
        return model
    return built


HF = {"llama": llama, "mistral": mistral, "gpt2": gpt2, "llama4": llama4, "llama_eager": eager(llama),
      "mistral_eager": eager(mistral), "gpt2_eager": eager(gpt2)}


def padded(seq: int = 16) -> dict[str, torch.Tensor]:
    """A batch of 2 whose second row is left-padded by 5 (masked, labelled -100)."""
    ids = models.tokens(2, seq, 1)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    ids = ids.masked_fill(mask == 0, 0)
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def packed(seq: int = 16) -> dict[str, torch.Tensor]:
    """Documents packed into rows, as ``DataCollatorWithFlattening`` packs them: position ids restarting at each
    document (lengths 5, 7, 4 and 9, 7), the first token of each labelled -100."""
    ids = models.tokens(2, seq, 3)
    positions = torch.cat([torch.cat([torch.arange(n) for n in lengths])[None]
                           for lengths in ((5, 7, 4), (9, 7))])
    labels = ids.masked_fill(positions == 0, -100)
    return {"input_ids": ids, "position_ids": positions, "labels": labels}


BATCHES = {"padded": padded, "packed": packed}


def train_batch(rank: int, world: int, name: str, batch_name: str, exchange: str = "auto") -> dict:
    """cp=world on a Hugging Face ``name`` with the ``batch_name`` batch by keyword and the model's own loss:
    eval outputs, STEPS AdamW steps (losses, gradients) and the parameters after them equal the unsharded model's."""
    batch = BATCHES[batch_name]()
    ref = HF[name]()
    pm = autotp.parallelize(ref, cp=world, tp=1, example_inputs=batch, cp_exchange=exchange)
    _check_exchange(pm, exchange)
    pm.eval(), ref.eval()
    with torch.no_grad():
        got, want = pm(**batch).logits, ref(**batch, use_cache=False).logits
    assert_close(got, want, rtol=1e-5, atol=1e-6)
    errors = {"output": float((got - want).abs().max()), "loss": 0.0, "grad": 0.0}
    pm.train(), ref.train()
    opt, ref_opt = torch.optim.AdamW(pm.parameters(), **ADAM), torch.optim.AdamW(ref.parameters(), **ADAM)
    for _ in range(STEPS):
        loss = pm.step(**batch)
        ref_loss = ref(**batch, use_cache=False).loss
        ref_loss.backward()
        assert_close(loss, ref_loss.detach(), rtol=1e-5, atol=1e-6)
        errors["loss"] = max(errors["loss"], float((loss - ref_loss.detach()).abs()))
        errors["grad"] = max(errors["grad"], _check_grads(pm, ref, name))
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
    _check_params(pm, ref, name)
    return errors


def _check_exchange(pm, exchange: str) -> None:
    """Every attention of ``pm`` exchanges by ``exchange`` (``auto``: any)."""
    if exchange in ("auto", "all_gather"):
        return
    for gm in pm.rank_modules():
        names = [n for n, _ in gm.named_modules()]
        assert any(n.startswith(f"cp_{exchange}_") for n in names) and not any(
            n.startswith("cp_kv_") for n in names), (exchange, names)


def train_cases(rank: int, world: int, cases) -> list[dict]:
    """Several trainings in one spawned group: each case ``(name, batch or None, exchange)`` as ``train_batch``
    (a batch) or ``train_against_unsharded`` (None: token ids and a loss_fn)."""
    return [train_batch(rank, world, name, batch, exchange) if batch else
            train_against_unsharded(rank, world, name, exchange=exchange) for name, batch, exchange in cases]


def saved_and_moved(rank: int, world: int, seq: int = 256, exchange: str = "all_gather", name: str = "llama") -> dict:
    """The tiny Llama at ``seq`` tokens: bytes saved for backward by one training step at cp=world and in one
    process, and the bytes this rank's key/value exchanges received (forward and backward), with their minimum
    (``planning.context_exchange.exchange_cost``)."""
    from bench.memory import SavedActivations
    from autotp.planning.context_exchange import AttentionShape, exchange_cost

    ref = HF[name]()
    x, y = models.tokens(1, seq, 1), models.tokens(1, seq, 2)
    pm = autotp.parallelize(ref, cp=world, tp=1, example_inputs=x, cp_exchange=exchange)
    _check_exchange(pm, exchange)
    out = {}
    for label, module in (("cp", pm), ("unsharded", ref)):
        saved = SavedActivations(list(module.parameters()))
        with saved:
            loss = models.loss_fn(module(x), y) if module is ref else pm.loss(x, target=y, loss_fn=models.loss_fn)
        loss.backward()
        out[label] = saved.bytes
    config = ref.config
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads  # GPT-2: no GQA
    shape = AttentionShape(1, seq, config.num_attention_heads, kv_heads, config.hidden_size // config.num_attention_heads)
    # all-gather: K and V forward, their gradients' shares backward, (world - 1) / world of each whole
    assert exchange_cost("all_gather", shape, world).received == 2 * 2 * seq * shape.kv_heads * shape.head_dim * 4 \
        * (world - 1) // world
    out["minimum"] = config.num_hidden_layers * exchange_cost(exchange, shape, world).received
    out["received"] = sum(m.received for gm in pm.rank_modules() for key, m in gm.named_modules()
                          if key.startswith(("cp_kv_", "cp_ring_", "cp_ulysses_")))
    return out


def exchange_suite(rank: int, world: int, cases, moved: list[tuple[str, str]], seq: int = 64) -> dict:
    """``train_cases(cases)``, then ``saved_and_moved`` for each ``(exchange, model name)`` of ``moved``: one
    spawned group for all of them."""
    return {"errors": train_cases(rank, world, cases),
            "moved": {exchange: saved_and_moved(rank, world, seq, exchange, name) for exchange, name in moved}}


def wrong_positions_report(monkeypatch, tp: int, rank: int):
    """The checker's report on the hand-written decoder at cp=2 (and ``tp``) with simulated ``rank`` told it holds
    cp rank 0's positions. (The wrong rank may leave its peer waiting at a collective, so the simulated ranks wait
    20 s here, not 120.)"""
    from autotp.rewrite.comm import ThreadComm

    group = ThreadComm.group
    monkeypatch.setattr(ThreadComm, "group", lambda size, timeout=20.0: group(size, timeout))

    def wrong(modules, comms):
        modules[rank].cp_positions.rank = 0

    return autotp.check(build("odd"), tp, models.tokens(2, 16, 1), cp=2, modules_hook=wrong)
