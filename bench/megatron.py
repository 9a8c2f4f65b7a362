"""The hand-written reference: examples/gpt.py's GPT, tensor-parallel the way Megatron-LM writes it by hand.

VocabParallelEmbedding, ColumnParallelLinear (the fused QKV split per part, so each rank holds its
share of Q, K and V), RowParallelLinear (bias added once, after the all-reduce) and the conjugate
operators f and g (Shoeybi et al. 2019, "Megatron-LM", section 3). Weights are sliced from a built
``examples.gpt.GPT``, so both start from the same seeded parameters. Like Megatron, the all-reduces
work in place on the tensor they are handed (a fresh matmul output or gradient). ``MegatronStage`` cuts
the same model into pipeline stages by hand.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F


class _CopyToTP(torch.autograd.Function):
    """f: identity forward, all-reduce of the gradient backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    """g: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.contiguous()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherLastDim(torch.autograd.Function):
    """All-gather along the last dimension forward; keep this rank's slice of the gradient backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx, grad):
        rank, tp = dist.get_rank(ctx.group), dist.get_world_size(ctx.group)
        return grad.chunk(tp, dim=-1)[rank].contiguous(), None


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Megatron-LM's ``vocab_parallel_cross_entropy``: per-token loss from this rank's vocabulary slice of the
    logits, by all-reducing the max, the target logit and the sum of exponentials; backward local."""

    @staticmethod
    def forward(ctx, logits, target, group):
        rank, local = dist.get_rank(group), logits.shape[-1]
        top = logits.max(dim=-1).values
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - top.unsqueeze(-1)
        offset = target - rank * local
        outside = (offset < 0) | (offset >= local)
        index = offset.masked_fill(outside, 0).unsqueeze(-1)
        predicted = shifted.gather(-1, index).squeeze(-1).masked_fill(outside, 0.0)
        dist.all_reduce(predicted, group=group)
        exp = shifted.exp()
        total = exp.sum(dim=-1)
        dist.all_reduce(total, group=group)
        softmax = exp.div_(total.unsqueeze(-1))
        ctx.save_for_backward(softmax, index, outside)
        return total.log() - predicted

    @staticmethod
    def backward(ctx, grad):
        softmax, index, outside = ctx.saved_tensors
        grad_input = softmax.scatter_add(-1, index, -(~outside).unsqueeze(-1).to(softmax.dtype))
        return grad_input * grad.unsqueeze(-1), None, None


def _shard(t: torch.Tensor, dim: int, rank: int, tp: int) -> nn.Parameter:
    return nn.Parameter(t.detach().chunk(tp, dim=dim)[rank].clone())


def _fused_shard(t: torch.Tensor, parts: int, rank: int, tp: int) -> nn.Parameter:
    """Rank ``rank``'s share of every part of a fused tensor along dim 0 (Q, K and V side by side)."""
    return nn.Parameter(torch.cat([p.chunk(tp, dim=0)[rank] for p in t.detach().chunk(parts, dim=0)]).clone())


def _copy(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t.detach().clone())


class ColumnParallelLinear(nn.Module):
    """y_r = f(x) W_r^T + b_r: this rank's output features; the input's gradient is all-reduced."""

    def __init__(self, linear: nn.Linear, group, parts: int = 1):
        super().__init__()
        rank, tp = dist.get_rank(group), dist.get_world_size(group)
        self.group = group
        self.weight = _fused_shard(linear.weight, parts, rank, tp)
        self.bias = _fused_shard(linear.bias, parts, rank, tp) if linear.bias is not None else None

    def forward(self, x):
        return F.linear(_CopyToTP.apply(x, self.group), self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """y = g(x_r W_r^T) + b: this rank's input features; partial sums all-reduced, bias added once."""

    def __init__(self, linear: nn.Linear, group):
        super().__init__()
        rank, tp = dist.get_rank(group), dist.get_world_size(group)
        self.group = group
        self.weight = _shard(linear.weight, 1, rank, tp)
        self.bias = _copy(linear.bias) if linear.bias is not None else None

    def forward(self, x):
        y = _ReduceFromTP.apply(F.linear(x, self.weight), self.group)
        return y + self.bias if self.bias is not None else y


class VocabParallelEmbedding(nn.Module):
    """This rank's rows of the token table; ids outside them look up zeros, and g sums the ranks."""

    def __init__(self, embedding: nn.Embedding, group):
        super().__init__()
        rank, tp = dist.get_rank(group), dist.get_world_size(group)
        self.group = group
        self.weight = _shard(embedding.weight, 0, rank, tp)
        rows = self.weight.shape[0]
        self.start, self.end = rank * rows, (rank + 1) * rows

    def forward(self, ids):
        outside = (ids < self.start) | (ids >= self.end)
        local = F.embedding((ids - self.start).masked_fill(outside, 0), self.weight)
        return _ReduceFromTP.apply(local.masked_fill(outside.unsqueeze(-1), 0.0), self.group)


class ParallelAttention(nn.Module):
    """Causal self-attention over this rank's n_head / tp heads."""

    def __init__(self, attn: nn.Module, group):
        super().__init__()
        tp = dist.get_world_size(group)
        self.c_attn = ColumnParallelLinear(attn.c_attn, group, parts=3)
        self.c_proj = RowParallelLinear(attn.c_proj, group)
        self.local_heads, self.local_embd = attn.n_head // tp, attn.n_embd // tp

    def forward(self, x):
        B, T, _ = x.size()
        q, k, v = self.c_attn(x).split(self.local_embd, dim=2)
        q, k, v = (t.view(B, T, self.local_heads, -1).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, self.local_embd))


class ParallelMLP(nn.Module):
    """Column-split expansion, GELU, row-split projection."""

    def __init__(self, mlp: nn.Module, group):
        super().__init__()
        self.c_fc = ColumnParallelLinear(mlp.c_fc, group)
        self.c_proj = RowParallelLinear(mlp.c_proj, group)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x)))


class _LayerNorm(nn.Module):
    """A replicated copy of examples.gpt's LayerNorm."""

    def __init__(self, ln: nn.Module):
        super().__init__()
        self.weight = _copy(ln.weight)
        self.bias = _copy(ln.bias) if ln.bias is not None else None

    def forward(self, x):
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, 1e-5)


class ParallelBlock(nn.Module):
    """Pre-LN block: replicated norms and residual stream, split attention and MLP."""

    def __init__(self, block: nn.Module, group):
        super().__init__()
        self.ln_1, self.ln_2 = _LayerNorm(block.ln_1), _LayerNorm(block.ln_2)
        self.attn, self.mlp = ParallelAttention(block.attn, group), ParallelMLP(block.mlp, group)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class MegatronGPT(nn.Module):
    """examples.gpt.GPT split over ``group``: vocabulary-split tied embedding and head, split blocks.

    The head is Megatron's ``parallel_lm_logits``: f, then a matmul with this rank's rows of the tied table.
    ``forward`` gathers the logits (``parallel_output=False``, the full logits on every rank, as the unsharded
    model returns); ``forward(idx, target)`` gives the loss Megatron trains on, from the split logits.
    """

    def __init__(self, gpt: nn.Module, group):
        super().__init__()
        if gpt.transformer.wte.weight is not gpt.lm_head.weight:
            raise ValueError("MegatronGPT mirrors examples.gpt.GPT, whose embedding and LM head are tied")
        self.group = group
        self.wte = VocabParallelEmbedding(gpt.transformer.wte, group)
        self.wpe = nn.Embedding.from_pretrained(gpt.transformer.wpe.weight.detach().clone(), freeze=False)
        self.h = nn.ModuleList(ParallelBlock(b, group) for b in gpt.transformer.h)
        self.ln_f = _LayerNorm(gpt.transformer.ln_f)

    def forward(self, idx, target=None):
        """Full logits (B, T, vocab) on every rank; with ``target``, the mean cross-entropy as Megatron trains:
        from this rank's vocabulary slice of the logits, never gathered (``parallel_output=True`` and
        ``vocab_parallel_cross_entropy``)."""
        if target is not None:
            return _VocabParallelCrossEntropy.apply(self._local_logits(idx), target, self.group).mean()
        return _GatherLastDim.apply(self._local_logits(idx), self.group)

    def _local_logits(self, idx):
        x = _embed(self.wte, self.wpe, idx)
        for block in self.h:
            x = block(x)
        return F.linear(_CopyToTP.apply(self.ln_f(x), self.group), self.wte.weight)


def _embed(wte: VocabParallelEmbedding, wpe: nn.Embedding, idx: torch.Tensor) -> torch.Tensor:
    pos = torch.arange(idx.shape[1], device=idx.device)
    return wte(idx) + wpe(pos)


def _head(ln_f: _LayerNorm, wte: VocabParallelEmbedding, group, x: torch.Tensor) -> torch.Tensor:
    logits = F.linear(_CopyToTP.apply(ln_f(x), group), wte.weight)
    return _GatherLastDim.apply(logits, group)


class MegatronStage(nn.Module):
    """A contiguous run of a MegatronGPT's blocks as one pipeline stage, split by hand.

    The first stage also embeds; the last applies ``ln_f`` and the head. Both hold this rank's
    vocabulary shard of the tied table (the same tensor values), so, as Megatron-LM does for its
    "embedding group", the caller must sum that weight's gradient across the two after backward.
    """

    def __init__(self, gpt: MegatronGPT, blocks: range, first: bool, last: bool):
        super().__init__()
        self.group, self.first, self.last = gpt.group, first, last
        self.h = nn.ModuleList(gpt.h[i] for i in blocks)
        self.wte = gpt.wte if first or last else None
        self.wpe = gpt.wpe if first else None
        self.ln_f = gpt.ln_f if last else None

    def forward(self, x):
        """Token ids -> hidden (first), hidden -> hidden, or hidden -> full logits (last)."""
        if self.first:
            x = _embed(self.wte, self.wpe, x)
        for block in self.h:
            x = block(x)
        return _head(self.ln_f, self.wte, self.group, x) if self.last else x
