"""A small Llama-style decoder, written by hand in plain PyTorch.

It has the features that make Llama different from GPT-2: RMSNorm, rotary
position embeddings (RoPE), grouped-query attention (fewer key/value heads than
query heads, expanded with ``repeat_kv``) and a SwiGLU feed-forward network,
with separate, bias-free q/k/v/o projections.  autotp's tests and demos use it
as an "unmodified" transformer to tensor-parallelise; it does not import
``transformers``.
"""

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class LlamaConfig:
    """Hyper-parameters of the Llama model (tiny defaults for tests)."""

    vocab_size: int = 128
    """Number of tokens in the vocabulary."""
    dim: int = 64
    """Width of the residual stream."""
    n_layers: int = 2
    """Number of transformer blocks."""
    n_heads: int = 4
    """Number of query heads; must divide ``dim``."""
    n_kv_heads: int = 2
    """Number of key/value heads; must divide ``n_heads`` (grouped-query attention)."""
    hidden_dim: int = 128
    """Inner width of the SwiGLU feed-forward network."""
    max_seq_len: int = 64
    """Longest sequence the precomputed RoPE tables cover."""
    rope_theta: float = 10000.0
    """Base of the RoPE frequencies."""
    norm_eps: float = 1e-5
    """Epsilon added inside RMSNorm's square root."""
    tie_embeddings: bool = False
    """Whether the output projection shares its weight with the token embedding."""


class RMSNorm(nn.Module):
    """Root-mean-square LayerNorm without mean-centering or bias."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        # normalise in float32 so half-precision inputs don't lose accuracy
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.type_as(x)


def precompute_rope(head_dim: int, max_seq_len: int, theta: float = 10000.0):
    """Return (cos, sin) tables of shape (max_seq_len, head_dim) for RoPE."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    t = torch.arange(max_seq_len, dtype=torch.float32)
    freqs = torch.outer(t, inv_freq)  # (max_seq_len, head_dim // 2)
    # duplicate so each half of the head dimension sees the same frequencies,
    # matching the rotate_half pairing (i, i + head_dim // 2)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def rotate_half(x):
    """Rotate half the hidden dims: (x1, x2) -> (-x2, x1)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x, cos, sin):
    """Apply rotary embeddings to ``x`` of shape (B, n_heads, T, head_dim)."""
    # cos/sin are (T, head_dim) and broadcast over batch and heads
    return (x * cos) + (rotate_half(x) * sin)


def repeat_kv(x, n_rep: int):
    """Repeat key/value heads: (B, n_kv, T, hd) -> (B, n_kv * n_rep, T, hd)."""
    b, n_kv, t, hd = x.shape
    if n_rep == 1:
        return x
    x = x[:, :, None, :, :].expand(b, n_kv, n_rep, t, hd)
    return x.reshape(b, n_kv * n_rep, t, hd)


class Attention(nn.Module):
    """Causal grouped-query self-attention with rotary position embeddings."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        assert config.dim % config.n_heads == 0
        assert config.n_heads % config.n_kv_heads == 0
        self.n_heads = config.n_heads
        self.n_kv_heads = config.n_kv_heads
        self.head_dim = config.dim // config.n_heads
        # each key/value head is shared by this many query heads
        self.n_rep = self.n_heads // self.n_kv_heads
        self.wq = nn.Linear(config.dim, self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(config.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(config.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(self.n_heads * self.head_dim, config.dim, bias=False)

    def forward(self, x, cos, sin):
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)

        q = apply_rope(q, cos, sin)
        k = apply_rope(k, cos, sin)

        # expand the shared key/value heads so every query head has a partner
        k = repeat_kv(k, self.n_rep)
        v = repeat_kv(v, self.n_rep)

        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).reshape(B, T, -1)
        return self.wo(y)


class FeedForward(nn.Module):
    """SwiGLU feed-forward network: ``w2(silu(w1(x)) * w3(x))``."""

    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)  # gate
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)  # down projection
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)  # up projection

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    """One pre-norm Llama block: attention then feed-forward, each with a residual."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.attention_norm = RMSNorm(config.dim, eps=config.norm_eps)
        self.attention = Attention(config)
        self.ffn_norm = RMSNorm(config.dim, eps=config.norm_eps)
        self.feed_forward = FeedForward(config.dim, config.hidden_dim)

    def forward(self, x, cos, sin):
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Module):
    """Decoder-only Llama language model mapping token ids to next-token logits."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(TransformerBlock(config) for _ in range(config.n_layers))
        self.norm = RMSNorm(config.dim, eps=config.norm_eps)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)

        # RoPE tables are derived from the config, not learned, so keep them out
        # of the state dict; they still follow the model across .to(device)
        cos, sin = precompute_rope(config.dim // config.n_heads, config.max_seq_len, config.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

        self.apply(self._init_weights)
        if config.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight

    def _init_weights(self, module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, tokens):
        """Return logits of shape (B, T, vocab_size) for every position of ``tokens``."""
        _, T = tokens.shape
        cos = self.rope_cos[:T]
        sin = self.rope_sin[:T]
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, cos, sin)
        h = self.norm(h)
        return self.output(h)


def build_llama(**overrides) -> Llama:
    """Build a :class:`Llama` from the default :class:`LlamaConfig` with ``overrides`` applied.

    The caller is responsible for seeding (``torch.manual_seed``) if it wants
    reproducible weights.
    """
    return Llama(LlamaConfig(**overrides))
