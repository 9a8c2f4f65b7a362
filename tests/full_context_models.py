"""Models whose causal-mask buffers and position tables are sliced to the sequence (``mask[:T, :T]``, ``pos[:T]``,
``bias[:, :, :T, :T]``, an embedding read with ``arange(T)``): the usual training shape, tested at full context
(an example exactly as long as the tables) and shorter."""

from __future__ import annotations

import torch
from torch import nn

from tests.models import VOCAB, _hf

POSITIONS = 16
"""The length of every table here: an example of 16 tokens reads them whole."""


class _Block(nn.Module):
    """Pre-norm causal attention (masked by the caller's mask) and an MLP, with dropout on both outputs."""

    def __init__(self, dim: int, heads: int, dropout: float):
        super().__init__()
        self.heads, self.norm1, self.norm2 = heads, nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.out = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.up, self.down = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)
        self.drop = nn.Dropout(dropout)

    def forward(self, x, keep):
        B, T, C = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(C, dim=-1)
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))
        scores = (q @ k.transpose(-2, -1)) * (C // self.heads) ** -0.5
        att = scores.masked_fill(keep == 0, float("-inf")).softmax(dim=-1)
        x = x + self.drop(self.out((att @ v).transpose(1, 2).reshape(B, T, C)))
        return x + self.drop(self.down(torch.relu(self.up(self.norm2(x)))))


class OddLM(nn.Module):
    """A decoder written the way training scripts write it. ``positions``: a learnt table read ``pos[:T]``
    ("param") or an ``nn.Embedding`` read with ``arange(T)`` ("embedding"); ``mask``: a causal-mask buffer read
    ``mask[:T, :T]`` ("2d") or GPT-2's ``bias[:, :, :T, :T]`` ("4d")."""

    def __init__(self, positions: str = "param", mask: str = "2d", dropout: float = 0.0, dim: int = 64,
                 heads: int = 4, layers: int = 2):
        super().__init__()
        self.positions, self.mask_kind = positions, mask
        self.tok = nn.Embedding(VOCAB, dim)
        if positions == "param":
            self.pos = nn.Parameter(torch.randn(POSITIONS, dim) * 0.02)
        else:
            self.pos = nn.Embedding(POSITIONS, dim)
        causal = torch.tril(torch.ones(POSITIONS, POSITIONS))
        self.register_buffer("mask", causal if mask == "2d" else causal.view(1, 1, POSITIONS, POSITIONS))
        self.blocks = nn.ModuleList(_Block(dim, heads, dropout) for _ in range(layers))
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, VOCAB, bias=False)

    def forward(self, ids):
        T = ids.shape[1]
        pos = self.pos[:T] if self.positions == "param" else self.pos(torch.arange(T, device=ids.device))
        keep = self.mask[:T, :T] if self.mask_kind == "2d" else self.mask[:, :, :T, :T]
        x = self.tok(ids) + pos
        for block in self.blocks:
            x = block(x, keep)
        return self.head(self.norm(x))


def hf_model(name: str) -> nn.Module:
    """A small Hugging Face decoder whose position table (and, for GPT-Neo and OpenAI GPT, causal-mask buffer) is
    ``POSITIONS`` long; dropout off."""
    small = dict(vocab_size=VOCAB)
    if name == "gpt2":
        return _hf("GPT2Config", "GPT2LMHeadModel", **small, n_embd=64, n_layer=2, n_head=4, n_positions=POSITIONS,
                   resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    if name == "openai-gpt":
        return _hf("OpenAIGPTConfig", "OpenAIGPTLMHeadModel", **small, n_embd=64, n_layer=2, n_head=4,
                   n_positions=POSITIONS, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    if name == "gpt_neo":  # one global and one local (windowed) layer: two mask buffers
        return _hf("GPTNeoConfig", "GPTNeoForCausalLM", **small, hidden_size=64, num_layers=2, num_heads=4,
                   attention_types=[[["global", "local"], 1]], window_size=4, max_position_embeddings=POSITIONS,
                   intermediate_size=128, embed_dropout=0.0, attention_dropout=0.0, resid_dropout=0.0)
    if name == "opt":
        return _hf("OPTConfig", "OPTForCausalLM", **small, hidden_size=64, num_hidden_layers=2,
                   num_attention_heads=4, ffn_dim=128, word_embed_proj_dim=64, max_position_embeddings=POSITIONS,
                   dropout=0.0, attention_dropout=0.0)
    if name == "llama":
        return _hf("LlamaConfig", "LlamaForCausalLM", **small, hidden_size=64, intermediate_size=128,
                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                   max_position_embeddings=POSITIONS)
    raise ValueError(f"no small {name}")


HF_NAMES = ("gpt2", "openai-gpt", "gpt_neo", "opt", "llama")
