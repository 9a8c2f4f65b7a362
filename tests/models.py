"""The small models the tests shard: the hand-written examples and Hugging Face models from configs."""

from __future__ import annotations

import torch

from examples.gpt import build_gpt
from examples.llama import build_llama

VOCAB = 128


def _hf(config_name: str, model_name: str, **config):
    import transformers

    cfg = getattr(transformers, config_name)(**config)
    return getattr(transformers, model_name)(cfg)


def _decoder(config_name: str, model_name: str, **extra):
    return lambda layers=2: _hf(config_name, model_name, vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, **extra)


class RawGPT(torch.nn.Module):
    """A GPT written with bare parameters: fused QKV as ``x @ W + b``, hand-made causal softmax attention,
    biases added by hand. Nothing here is an nn.Linear, so detection must work on the ops alone."""

    def __init__(self, layers: int = 2, dim: int = 64, heads: int = 4):
        super().__init__()
        self.heads = heads
        self.embed = torch.nn.Parameter(torch.randn(VOCAB, dim) * 0.02)
        self.blocks = torch.nn.ModuleList(RawBlock(dim) for _ in range(layers))
        self.register_buffer("causal", torch.tril(torch.ones(64, 64, dtype=torch.bool)), persistent=False)

    def forward(self, ids):
        x = torch.nn.functional.embedding(ids, self.embed)
        for block in self.blocks:
            x = block(x, self.heads, self.causal)
        return x @ self.embed.t()


class RawBlock(torch.nn.Module):
    """One pre-norm block of RawGPT."""

    def __init__(self, dim: int):
        super().__init__()
        p = lambda *shape: torch.nn.Parameter(torch.randn(*shape) * 0.02)  # noqa: E731
        self.norm = torch.nn.LayerNorm(dim)
        self.w_qkv, self.b_qkv, self.w_out, self.b_out = p(dim, 3 * dim), p(3 * dim), p(dim, dim), p(dim)
        self.w_up, self.b_up, self.w_down = p(dim, 4 * dim), p(4 * dim), p(4 * dim, dim)

    def forward(self, x, heads, causal):
        b, t, d = x.shape
        q, k, v = (x @ self.w_qkv + self.b_qkv).split(d, dim=-1)
        q, k, v = (z.view(b, t, heads, d // heads).transpose(1, 2) for z in (q, k, v))
        scores = (q @ k.transpose(-2, -1)) * (d // heads) ** -0.5
        scores = scores.masked_fill(~causal[:t, :t], float("-inf"))
        y = (scores.softmax(dim=-1) @ v).transpose(1, 2).reshape(b, t, d)
        x = x + y @ self.w_out + self.b_out
        h = self.norm(x)
        return x + torch.relu(h @ self.w_up + self.b_up) @ self.w_down


BUILDERS = {
    "gpt": lambda layers=2: build_gpt(n_layer=layers),
    "llama": lambda layers=2: build_llama(n_layers=layers),
    "raw_gpt": lambda layers=2: RawGPT(layers),
    "hf_llama": _decoder("LlamaConfig", "LlamaForCausalLM"),
    "hf_mistral": _decoder("MistralConfig", "MistralForCausalLM"),
    "hf_qwen2": _decoder("Qwen2Config", "Qwen2ForCausalLM"),
    "hf_gpt2": lambda layers=2: _hf("GPT2Config", "GPT2LMHeadModel", vocab_size=VOCAB, n_embd=64, n_layer=layers,
                                    n_head=4, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
    "hf_bert": lambda layers=2: _hf("BertConfig", "BertModel", vocab_size=VOCAB, hidden_size=64,
                                    num_hidden_layers=layers, num_attention_heads=4, intermediate_size=128,
                                    hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0),
}
"""Every model, built from a fixed seed by the caller; all have 4 heads, so tp in {1, 2, 4} fits."""

HAS_LM_HEAD = {name: name != "hf_bert" for name in BUILDERS}


def build(name: str, layers: int = 2, seed: int = 0) -> torch.nn.Module:
    """Model ``name`` with ``layers`` blocks and weights drawn from ``seed``."""
    torch.manual_seed(seed)
    return BUILDERS[name](layers)


def tokens(batch: int, seq: int, seed: int) -> torch.Tensor:
    """Random token ids."""
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


def first_tensor(output) -> torch.Tensor:
    """The main tensor of a model output: logits, last hidden state, or the tensor itself."""
    if isinstance(output, torch.Tensor):
        return output
    for key in ("logits", "last_hidden_state"):
        if getattr(output, key, None) is not None:
            return getattr(output, key)
    raise TypeError(type(output))


def loss_fn(output, target: torch.Tensor) -> torch.Tensor:
    """Cross-entropy on logits for LMs; for encoders, a regression of the hidden states and pooled output."""
    main = first_tensor(output)
    if target.dtype == torch.long:
        return torch.nn.functional.cross_entropy(main.reshape(-1, main.shape[-1]), target.reshape(-1))
    pooled = getattr(output, "pooler_output", None)
    extra = pooled.pow(2).mean() if pooled is not None else 0.0
    return torch.nn.functional.mse_loss(main, target) + extra


def target_for(name: str, batch: int, seq: int, seed: int) -> torch.Tensor:
    """A training target matching model ``name``'s output."""
    if HAS_LM_HEAD[name]:
        return tokens(batch, seq, seed)
    return torch.randn(batch, seq, 64, generator=torch.Generator().manual_seed(seed))


class PaddedLM(torch.nn.Module):
    """An embedding with a padding row (``pad``), an MLP block, and a tied or untied head."""

    def __init__(self, tied: bool = True, vocab: int = 64, dim: int = 32, pad: int = 3):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim, padding_idx=pad)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(dim, 4 * dim), torch.nn.GELU(), torch.nn.Linear(4 * dim, dim))
        self.head = torch.nn.Linear(dim, vocab, bias=False)
        if tied:
            self.head.weight = self.embed.weight

    def forward(self, ids):
        x = self.embed(ids)
        return self.head(x + self.mlp(x))


def padded_ids(pad: int = 3, vocab: int = 64, seed: int = 4) -> torch.Tensor:
    """Token ids whose last three positions are the pad id (a padded batch)."""
    ids = torch.randint(0, vocab, (2, 12), generator=torch.Generator().manual_seed(seed))
    ids[:, -3:] = pad
    return ids


class RelativeAttention(torch.nn.Module):
    """Attention with a learned bias per clamped relative position; the scale and the bucket indices are built
    in every block from the sizes alone, as DeBERTa's disentangled attention builds them."""

    def __init__(self, width: int = 32, heads: int = 4, span: int = 4):
        super().__init__()
        self.heads, self.span = heads, span
        self.qkv, self.out = torch.nn.Linear(width, 3 * width), torch.nn.Linear(width, width)
        self.bias = torch.nn.Embedding(2 * span + 1, heads)

    def forward(self, x):
        b, t, w = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, w // self.heads).permute(2, 0, 3, 1, 4)
        scale = torch.sqrt(torch.tensor(w // self.heads, dtype=torch.float) * 2)
        positions = torch.arange(t, device=x.device)
        buckets = torch.clamp(positions[None, :] - positions[:, None] + self.span, 0, 2 * self.span)
        scores = q @ k.transpose(-1, -2) / scale + self.bias(buckets).permute(2, 0, 1)
        return x + self.out((scores.softmax(-1) @ v).transpose(1, 2).reshape(b, t, w))


class RelativeLM(torch.nn.Module):
    """Token embedding, relative-position attention blocks, a head (``tests/test_computed_once.py``)."""

    def __init__(self, blocks: int = 3, vocab: int = 64, width: int = 32):
        super().__init__()
        self.embed, self.head = torch.nn.Embedding(vocab, width), torch.nn.Linear(width, vocab)
        self.blocks = torch.nn.ModuleList(RelativeAttention(width) for _ in range(blocks))

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class Square(torch.autograd.Function):
    """x * x as a user's own autograd Function (capture must record it as it runs)."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return 2 * x * grad
