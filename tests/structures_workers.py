"""Per-rank bodies of the structure tests on gloo: one tiny model of each structure autotp splits.

Mixture-of-experts (a 3-D expert bank), QK-norm over all heads, interleaved rotary with a parallel block,
encoder-decoders (cross-attention, per-head relative position bias, ``nn.Transformer``'s packed cross-attention
projections), ``nn.TransformerEncoder``, einsum attention with a gathered per-head bias and a projection split alone,
a Mamba mixer, and convolutions split by channels. Each rank builds every model from one seed, keeps an
unsharded copy, and compares outputs, the loss of every step and every parameter after AdamW steps; dropout
is off in every config.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

import autotp
from autotp.capture import model_kwargs
from tests import conv_models, models

SEED = 0
STEPS = 2
"""The second step reads the AdamW moments the first stored in each shard (tests/workers.py)."""
ADAM = dict(lr=1e-2, eps=1e-3)
"""Adam's first step moves an element by lr * g / (|g| + eps), whose slope in g is up to lr / eps. With eps
1e-6 (tests/workers.py) an element whose gradient is zero up to rounding turns fp32 rounding into visible steps:
T5's cross-attention query got gradients 3.7e-8 (one process) and 7.7e-9 (two ranks) at one element and
differed by 2.8e-5 after one step at lr 1e-3; Olmo2's embedding differed by 7.5e-4 after 3 steps at lr 1e-2,
though every parameter agrees to 1e-8 after the same 3 steps with SGD. eps 1e-3 bounds that gain by 10, so
TOL compares sharding, not amplified rounding."""
TOL = dict(rtol=1e-5, atol=1e-5)
"""Outputs, losses, and every parameter after AdamW (0.1% of one step)."""
VOCAB = models.VOCAB


def _hf(config_name: str, model_name: str, **config) -> nn.Module:
    import transformers

    return getattr(transformers, model_name)(getattr(transformers, config_name)(**config))


_DECODER = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, attention_dropout=0.0)


def mixtral() -> nn.Module:
    """Mixture of experts: 4 experts in one 3-D bank per layer, 2 routed per token."""
    return _hf("MixtralConfig", "MixtralForCausalLM", **_DECODER, num_local_experts=4, num_experts_per_tok=2)


def olmo2() -> nn.Module:
    """QK-norm: an RMSNorm over the whole q_proj (and k_proj) width, i.e. across all heads."""
    return _hf("Olmo2Config", "Olmo2ForCausalLM", **_DECODER, eos_token_id=2)


def gptj() -> nn.Module:
    """Interleaved rotary (stack, then flatten) and a parallel block (one norm feeds attention and MLP)."""
    return _hf("GPTJConfig", "GPTJForCausalLM", vocab_size=VOCAB, n_embd=64, n_head=4, rotary_dim=8, n_layer=2,
               n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)


def deepseek_v3() -> nn.Module:
    """Low-rank attention (DeepSeek's MLA: down-projection, norm, up-projection per head; a rotary key part shared
    by the heads) and, in its second layer, routed experts with a shared one."""
    return _hf("DeepseekV3Config", "DeepseekV3ForCausalLM", **(_DECODER | dict(num_key_value_heads=4)), head_dim=16,
               kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16,
               n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, n_shared_experts=1,
               first_k_dense_replace=1, n_group=1, topk_group=1)


def bart() -> nn.Module:
    """An encoder-decoder with cross-attention (K/V projections of the encoder's output)."""
    return _hf("BartConfig", "BartForConditionalGeneration", vocab_size=VOCAB, d_model=64, encoder_layers=2,
               decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128,
               decoder_ffn_dim=128, max_position_embeddings=64, dropout=0.0, attention_dropout=0.0,
               activation_dropout=0.0)


def t5() -> nn.Module:
    """An encoder-decoder whose attention adds a per-head relative position bias."""
    return _hf("T5Config", "T5ForConditionalGeneration", vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=128,
               num_layers=2, num_heads=4, dropout_rate=0.0, decoder_start_token_id=0)


def mamba() -> nn.Module:
    """A Mamba mixer: in_proj, a depthwise conv1d over channels, a selective scan, out_proj."""
    return _hf("MambaConfig", "MambaForCausalLM", vocab_size=VOCAB, hidden_size=64, state_size=8,
               num_hidden_layers=2, expand=2)


class TorchEncoderLM(nn.Module):
    """``nn.TransformerEncoder`` between a token embedding and an output head."""

    def __init__(self, dim: int = 64):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        layer = nn.TransformerEncoderLayer(dim, nhead=4, dim_feedforward=128, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.head = nn.Linear(dim, VOCAB)

    def forward(self, ids):
        return self.head(self.encoder(self.embed(ids)))


class TorchSeq2SeqLM(nn.Module):
    """``nn.Transformer`` with a causal decoder mask: its decoder's cross-attention slices one packed
    ``in_proj_weight`` into the query projection (decoder side) and the key/value projection (encoder side)."""

    def __init__(self, dim: int = 64):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.transformer = nn.Transformer(dim, 4, 1, 2, 128, dropout=0.0, batch_first=True)
        self.head = nn.Linear(dim, VOCAB)

    def forward(self, input_ids, decoder_input_ids, tgt_mask):
        return self.head(self.transformer(self.embed(input_ids), self.embed(decoder_input_ids), tgt_mask=tgt_mask))


class EinsumLM(nn.Module):
    """A narrow embedding projected into the residual stream (split alone by its input features, as ELECTRA's),
    einsum attention with a per-head bias picked per distance bucket by ``gather`` (ProphetNet-style), an MLP."""

    HEADS, BUCKETS = 4, 8

    def __init__(self, dim: int = 64):
        super().__init__()
        self.embed, self.project = nn.Embedding(VOCAB, dim // 2), nn.Linear(dim // 2, dim)
        self.qkv, self.out = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.rel = nn.Linear(dim, self.HEADS * self.BUCKETS)
        self.up, self.down, self.head = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim), nn.Linear(dim, VOCAB)

    def forward(self, ids):
        x = self.project(self.embed(ids))
        b, t, d = x.shape
        q, k, v = (z.view(b, t, self.HEADS, -1) for z in self.qkv(x).chunk(3, -1))
        table = self.rel(x).view(b, t, self.HEADS, self.BUCKETS).transpose(1, 2)
        buckets = (torch.arange(t)[:, None] - torch.arange(t)[None, :]).abs().clamp(max=self.BUCKETS - 1)
        scores = torch.einsum("bthd,bshd->bhts", q, k) + table.gather(3, buckets.expand(b, self.HEADS, t, t))
        x = x + self.out(torch.einsum("bhts,bshd->bthd", scores.softmax(-1), v).reshape(b, t, d))
        return self.head(x + self.down(torch.relu(self.up(x))))


class ClampedCoefficientsLM(nn.Module):
    """Gemma 3n's AltUp pattern: in training, the forward clamps a projection's weight in place through
    ``.data`` (outside autograd) before using it; the clip is tight, so it changes every step's weights. The
    clamped projection opens the MLP, so it is split by columns and each rank clamps its shard."""

    CLIP = 0.02

    def __init__(self, dim: int = 64):
        super().__init__()
        self.embed, self.up = nn.Embedding(VOCAB, dim), nn.Linear(dim, 2 * dim)
        self.down, self.head = nn.Linear(2 * dim, dim), nn.Linear(dim, VOCAB)

    def forward(self, ids):
        if self.training:
            self.up.weight.data.clamp_(-self.CLIP, self.CLIP)
        x = self.embed(ids)
        return self.head(x + self.down(torch.relu(self.up(x))))


def _ids(batch: int, seq: int, seed: int) -> dict[str, torch.Tensor]:
    return {"input_ids": models.tokens(batch, seq, seed)}


def _seq2seq(batch: int, seq: int, seed: int) -> dict[str, torch.Tensor]:
    decoder = models.tokens(batch, seq // 2, seed + 50)
    return {"input_ids": models.tokens(batch, seq, seed), "decoder_input_ids": decoder}


def _seq2seq_causal(batch: int, seq: int, seed: int) -> dict[str, torch.Tensor]:
    """``_seq2seq`` with the decoder's causal mask, as ``nn.Transformer``'s users pass it."""
    ids = _seq2seq(batch, seq, seed)
    return ids | {"tgt_mask": nn.Transformer.generate_square_subsequent_mask(ids["decoder_input_ids"].shape[1])}


def _positional(batch: int, seq: int, seed: int) -> tuple[torch.Tensor]:
    return (models.tokens(batch, seq, seed),)


@dataclass(frozen=True)
class Case:
    """One model of one structure."""

    build: Callable[[], nn.Module]
    inputs: Callable[[int, int, int], object]
    """(batch, seq, seed) -> the model's inputs: a dict of keyword tensors or a positional tuple."""
    must_split: tuple[str, ...] = ()
    """Parameter names the structure's split must cover (the test fails if autotp keeps them whole)."""
    example_seq: int = 16
    """Sequence length of the example inputs the model is captured on."""
    seq: int = 12
    """Sequence length of the training batches: the example's for a model whose code loops over positions
    (the capture then fixes it), another otherwise (sizes stay dynamic)."""
    batch: int = 3
    """Batch size of the training batches (another than the example's 2 unless the capture fixes it)."""


def _layers(*suffixes: str, layers: int = 2, stem: str = "model.layers") -> tuple[str, ...]:
    return tuple(f"{stem}.{i}.{s}" for i in range(layers) for s in suffixes)


CASES = {
    "mixtral (expert bank)": Case(mixtral, _ids, _layers("mlp.experts.gate_up_proj", "mlp.experts.down_proj")),
    "olmo2 (QK-norm)": Case(olmo2, _ids, _layers("self_attn.q_proj.weight", "self_attn.q_norm.weight",
                                                  "self_attn.k_norm.weight", "self_attn.o_proj.weight")),
    "gptj (interleaved rotary, parallel block)": Case(gptj, _ids, _layers(
        "attn.q_proj.weight", "attn.k_proj.weight", "attn.out_proj.weight", "mlp.fc_in.weight", "mlp.fc_out.weight",
        stem="transformer.h")),
    "deepseek_v3 (low-rank attention)": Case(deepseek_v3, _ids, _layers(
        "self_attn.q_b_proj.weight", "self_attn.kv_b_proj.weight", "self_attn.o_proj.weight")),
    "bart (cross-attention)": Case(bart, _seq2seq, (
        *_layers("encoder_attn.q_proj.weight", "encoder_attn.k_proj.weight", "encoder_attn.v_proj.weight",
                 "encoder_attn.out_proj.weight", stem="model.decoder.layers"),
        *_layers("fc1.weight", stem="model.encoder.layers"))),
    "t5 (relative position bias)": Case(t5, _seq2seq, (
        "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight",
        "decoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight",
        *_layers("layer.1.EncDecAttention.k.weight", "layer.1.EncDecAttention.v.weight", stem="decoder.block"))),
    "nn.TransformerEncoder": Case(TorchEncoderLM, _positional, _layers(
        "self_attn.in_proj_weight", "self_attn.out_proj.weight", "linear1.weight", "linear2.weight",
        stem="encoder.layers")),
    "nn.Transformer (packed cross-attention, causal mask)": Case(TorchSeq2SeqLM, _seq2seq_causal, _layers(
        "multihead_attn.in_proj_weight", "multihead_attn.in_proj_bias", "multihead_attn.out_proj.weight",
        "self_attn.in_proj_weight", stem="transformer.decoder.layers"), seq=16, batch=2),
    # (its capture fixes batch x source length: a guard 64 * B * S == 2048 from torch.export, before autotp plans)
    "einsum attention, gathered bias, lone row": Case(EinsumLM, _positional, (
        "project.weight", "qkv.weight", "rel.weight", "out.weight", "up.weight", "down.weight")),
    # Mamba's reference selective scan loops over positions: its sequence length is fixed, kept short.
    "mamba (conv1d and scan split by channel)": Case(mamba, _ids, _layers(
        "mixer.conv1d.weight", "mixer.in_proj.weight", "mixer.x_proj.weight", "mixer.dt_proj.weight",
        "mixer.A_log", "mixer.D", "mixer.out_proj.weight", stem="backbone.layers"), example_seq=8, seq=8),
    # batch norms in training: their running statistics (in the state dict compared) must match after the steps
    "convolutions (bottleneck, depthwise, batch and group norms)": Case(
        lambda: conv_models.ConvLM(VOCAB), _positional, (
            "conv1.weight", "conv2.weight", "block.conv1.weight", "block.bn1.weight", "block.conv2.weight",
            "expand.weight", "bn.weight", "depthwise.weight", "norm.weight", "project.weight")),
    "a weight clamped in place through .data (Gemma 3n's AltUp)": Case(
        ClampedCoefficientsLM, _positional, ("up.weight", "down.weight")),
    "weight-normed grouped convolution split by groups": Case(
        lambda: conv_models.PositionalConvLM(VOCAB), _positional, (
            "pos_conv.parametrizations.weight.original1", "pos_conv.bias", "up.weight", "down.weight")),
}


def _call(module: nn.Module, inputs, **extra):
    if isinstance(inputs, dict):
        return module(**inputs, **extra)
    return module(*inputs, **extra)


def _no_cache(model: nn.Module) -> dict:
    """What the reference is called with: no KV cache, as autotp calls the model it captures."""
    return model_kwargs(model)


def _loss(output, target: torch.Tensor) -> torch.Tensor:
    logits = models.first_tensor(output)
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def _target(batch, seed: int) -> torch.Tensor:
    """Token ids shaped like the logits: one per decoder position (encoder-decoders) or input position."""
    ids = batch.get("decoder_input_ids", batch["input_ids"]) if isinstance(batch, dict) else batch[0]
    return models.tokens(*ids.shape, seed)


def _split_names(plan: autotp.Plan) -> list[str]:
    return sorted(name for name, placement in plan.placements.items() if placement.is_split)


def _error(got: torch.Tensor, want: torch.Tensor) -> float:
    """The largest difference beyond the relative tolerance (0.0 when ``got`` is within TOL of ``want``)."""
    excess = (got.double() - want.double()).abs() - TOL["rtol"] * want.double().abs()
    return float(excess.max().clamp(min=0)) if excess.numel() else 0.0


def check_case(label: str, case: Case, world: int) -> dict:
    """Shard one model over ``world`` ranks and compare it with the unsharded original: outputs, the loss of
    STEPS AdamW steps and every parameter afterwards. Returns the measurements the test asserts on: errors beyond
    the relative tolerance (outputs, each step's loss, parameters), what was split and what had to be."""
    start = time.perf_counter()
    torch.manual_seed(SEED)
    ref = case.build()
    example = case.inputs(2, case.example_seq, 1)
    pm = autotp.parallelize(ref, tp=world, example_inputs=example)
    extra = _no_cache(ref)

    batches = [case.inputs(case.batch, case.seq, seed) for seed in range(2, 2 + STEPS)]  # not the example's sizes
    got, want = tree_leaves(_call(pm, batches[0])), tree_leaves(_call(ref, batches[0], **extra))
    outputs = [_error(g, w) for g, w in zip(got, want)] if len(got) == len(want) else [float("inf")]

    opt, ref_opt = torch.optim.AdamW(pm.parameters(), **ADAM), torch.optim.AdamW(ref.parameters(), **ADAM)
    losses = []
    for step, batch in enumerate(batches):
        target = _target(batch, seed=10 + step)
        loss = _step(pm, batch, target)
        ref_loss = _loss(_call(ref, batch, **extra), target)
        ref_loss.backward()
        losses.append(_error(loss, ref_loss.detach()))
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()

    full = pm.full_state_dict()
    params = {key: _error(full[key], value) for key, value in ref.state_dict().items() if key in full}
    return {"output": max(outputs), "losses": losses, "params": params, "missing_keys": sorted(set(ref.state_dict()) - set(full)),
            "split": _split_names(pm.plan), "must_split": list(case.must_split), "seconds": time.perf_counter() - start}


def _step(pm, batch, target: torch.Tensor) -> torch.Tensor:
    if isinstance(batch, dict):
        return pm.step(**batch, target=target, loss_fn=_loss)
    return pm.step(*batch, target=target, loss_fn=_loss)


def structures(rank: int, world: int, only: list[str] | None = None) -> dict:
    """``check_case`` for every case (or those named in ``only``) at tp=world, in one spawned group."""
    return {label: check_case(label, case, world) for label, case in CASES.items() if not only or label in only}
