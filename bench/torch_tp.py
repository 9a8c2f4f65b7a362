"""The torch baseline: ``parallelize_module`` with a hand-written ColwiseParallel/RowwiseParallel plan.

nanoGPT fuses Q, K and V into one ``c_attn`` and splits its output with ``split(n_embd)``; a plain
``ColwiseParallel`` shards that weight's rows in one block, so rank 0 would get all of Q and half of K
(``split(n_embd)`` of the 3·n_embd/2-wide local output then yields two tensors, not three, and the
forward fails). ``parallelize_module`` cannot express a
per-part split, so, as torchtitan does for its models, the baseline runs on a variant of the same GPT
with separate q/k/v projections whose forward infers the local head count (``view(B, T, -1, head_dim)``).
Its weights are the fused ones cut in three, so it computes exactly what the original computes.
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.nn import functional as F


class SeparateQKVAttention(nn.Module):
    """examples.gpt's attention with q, k, v as three Linears; head count read from the shapes."""

    def __init__(self, attn: nn.Module):
        super().__init__()
        d = attn.n_embd
        self.q, self.k, self.v = (nn.Linear(d, d, bias=attn.c_attn.bias is not None) for _ in range(3))
        for i, lin in enumerate((self.q, self.k, self.v)):
            lin.weight = nn.Parameter(attn.c_attn.weight.detach()[i * d:(i + 1) * d].clone())
            if lin.bias is not None:
                lin.bias = nn.Parameter(attn.c_attn.bias.detach()[i * d:(i + 1) * d].clone())
        self.c_proj = copy.deepcopy(attn.c_proj)
        self.head_dim = d // attn.n_head

    def forward(self, x):
        B, T, _ = x.size()
        # -1: the local head count, so the same code runs whole and column-split.
        q, k, v = (p(x).view(B, T, -1, self.head_dim).transpose(1, 2) for p in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, -1))


def separate_qkv(gpt: nn.Module) -> nn.Module:
    """A copy of an examples.gpt.GPT whose attentions have separate q/k/v (same function, same weights)."""
    out = copy.deepcopy(gpt)
    for block in out.transformer.h:
        block.attn = SeparateQKVAttention(block.attn)
    return out


def torch_tp_plan() -> dict:
    """The hand-written plan: Megatron's scheme in parallelize_module's vocabulary (torchtitan's style)."""
    return {
        "transformer.wte": RowwiseParallel(input_layouts=Replicate()),
        "transformer.h.*.attn.q": ColwiseParallel(),
        "transformer.h.*.attn.k": ColwiseParallel(),
        "transformer.h.*.attn.v": ColwiseParallel(),
        "transformer.h.*.attn.c_proj": RowwiseParallel(),
        "transformer.h.*.mlp.c_fc": ColwiseParallel(),
        "transformer.h.*.mlp.c_proj": RowwiseParallel(),
        "lm_head": ColwiseParallel(output_layouts=Replicate()),
    }


def torch_tp_model(gpt: nn.Module, mesh: DeviceMesh) -> nn.Module:
    """``parallelize_module`` applied to the separate-q/k/v copy of ``gpt``; the tied table is re-tied.

    parallelize_module distributes ``wte`` and ``lm_head`` one after the other, giving each its own
    DTensor; both are Shard(0) of the same table, so tying them again restores the original's sharing.
    """
    model = parallelize_module(separate_qkv(gpt), mesh, torch_tp_plan(), src_data_rank=None)
    model.lm_head.weight = model.transformer.wte.weight
    return model


def fused_colwise_error(gpt: nn.Module, mesh: DeviceMesh, idx: torch.Tensor) -> str:
    """What a plain ColwiseParallel on nanoGPT's fused c_attn does: the error it raises, or 'ran'."""
    plan = {"transformer.h.*.attn.c_attn": ColwiseParallel(), "transformer.h.*.attn.c_proj": RowwiseParallel()}
    model = parallelize_module(copy.deepcopy(gpt), mesh, plan, src_data_rank=None)
    try:
        model(idx)
    except (RuntimeError, ValueError) as e:  # q, k, v = split(...) gets two tensors: a ValueError
        return f"{type(e).__name__}: {str(e).splitlines()[0]}"
    return "ran"
