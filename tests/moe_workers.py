"""Per-rank bodies of the mixture-of-experts tests on gloo: the tiny Mixtral-style and DeepSeek-style models
train exactly, and their communication, counted at run time, is that of their dense twin (the same model with
a plain MLP in place of each mixture-of-experts layer, which Megatron's minimum covers: one all-reduce of the
B×T×D hidden state forward and one backward per layer) plus the routing weights' gradient, B×T×k numbers per
layer backward.
"""

from __future__ import annotations

import torch
from torch import nn

import autotp
from bench.comm import count_step
from tests import models, structures_workers
from tests.structures_workers import CASES, _DECODER, _hf, check_case

BATCH, SEQ, TOP_K, MOE_LAYERS = 3, 10, 2, 2


def mixtral(dense: bool = False) -> nn.Module:
    """Mixtral's routed experts (4, top-2); dense: Mistral, the same model with one MLP per layer."""
    if dense:
        return _hf("MistralConfig", "MistralForCausalLM", **_DECODER)
    return structures_workers.mixtral()


def deepseek(dense: bool = False) -> nn.Module:
    """DeepSeek-V3's routed experts (4, top-2) with a shared one in every layer; dense: one MLP per layer."""
    return _hf("DeepseekV3Config", "DeepseekV3ForCausalLM", **(_DECODER | dict(num_key_value_heads=4)), head_dim=16,
               kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16,
               n_routed_experts=4, num_experts_per_tok=TOP_K, moe_intermediate_size=64, n_shared_experts=1,
               first_k_dense_replace=2 if dense else 0, n_group=1, topk_group=1)


def gpt_oss() -> nn.Module:
    """GPT-OSS's routed experts (4, top-2): a grouped matmul per bank, each expert's bias picked per token and added
    in place to its partial output before the router's weight multiplies it."""
    return _hf("GptOssConfig", "GptOssForCausalLM", **_DECODER, head_dim=16, num_local_experts=4,
               num_experts_per_tok=TOP_K, layer_types=["full_attention"] * 2)


BUILDERS = {"mixtral": mixtral, "deepseek": deepseek}
PLANNED = BUILDERS | {"gpt_oss": gpt_oss}
"""The models whose plans and one-process checks test_moe asserts on (BUILDERS also on gloo)."""


class LoopedExperts(nn.Module):
    """Experts applied in a loop to the tokens routed to each (``torch.where``, then ``index_add_`` of the
    weighted outputs into zeros), between an embedding and a head: the older transformers MoE layout."""

    def __init__(self, dim: int = 32, experts: int = 4, k: int = TOP_K):
        super().__init__()
        self.k = k
        self.embed, self.head = nn.Embedding(64, dim), nn.Linear(dim, 64)
        self.router = nn.Linear(dim, experts, bias=False)
        self.up = nn.ModuleList(nn.Linear(dim, 2 * dim, bias=False) for _ in range(experts))
        self.down = nn.ModuleList(nn.Linear(2 * dim, dim, bias=False) for _ in range(experts))

    def forward(self, ids):
        h = self.embed(ids)
        x = h.flatten(0, 1)
        weights, chosen = self.router(x).softmax(-1).topk(self.k, dim=-1)
        out = torch.zeros_like(x)
        for e, (up, down) in enumerate(zip(self.up, self.down)):
            token, slot = torch.where(chosen == e)
            out.index_add_(0, token, down(torch.relu(up(x[token]))) * weights[token, slot, None])
        return self.head(h + out.view_as(h))


class _ExpertsHit(nn.Module):
    """Between an embedding and a head, experts run in a loop over those the batch routes tokens to (``nonzero``
    of a one-hot mask with a class for no expert, skipped, and again when an expert's tokens are none), as eager
    transformers MoE layers are written; ``expert(e, rows)`` is expert ``e`` on its tokens' rows."""

    def __init__(self, dim: int, experts: int, k: int, extra: bool = False, vocab: int = 64, skips: bool = True,
                 spare: int = 1):
        super().__init__()
        self.k, self.experts, self.extra, self.skips, self.spare = k, experts, extra, skips, spare
        self.embed, self.head = nn.Embedding(vocab, dim), nn.Linear(dim, vocab)
        self.router = nn.Linear(dim, experts, bias=False)

    def routes(self, ids: torch.Tensor) -> torch.Tensor:
        """The experts each token is routed to."""
        return self.router(self.embed(ids)).topk(self.k, dim=-1).indices

    def forward(self, ids):
        h = self.embed(ids)
        x = h.flatten(0, 1)
        weights, chosen = self.router(x).softmax(-1).topk(self.k, dim=-1)
        out = torch.zeros_like(x)
        with torch.no_grad():
            mask = torch.nn.functional.one_hot(chosen, self.experts + self.spare).permute(2, 1, 0)
            hit = (mask.sum(dim=(-1, -2)) > 0).nonzero()
        for expert in hit:
            expert = expert[0]
            if self.skips and expert == self.experts:  # without it, only the experts hit can be traced
                continue
            slot, token = torch.where(mask[expert])
            if token.numel() == 0:
                continue
            out.index_add_(0, token, self.expert(expert, x[token]) * weights[token, slot, None])
            if self.extra:
                out = out + self.bias[expert]
        return self.head(h + out.view_as(h))


class NamedExperts(nn.Module):
    """Experts as a ``ModuleDict`` keyed by name, picked in the loop over those hit with the expert read as a
    Python number (``self.experts[f"expert_{e[0]}"]``), and the router cast to the dtype it has on every call
    (Switch Transformers' layout: fp32 routing under mixed precision)."""

    def __init__(self, dim: int = 32, experts: int = 4):
        super().__init__()
        self.embed, self.head = nn.Embedding(64, dim), nn.Linear(dim, 64)
        self.router = nn.Linear(dim, experts, bias=False)
        self.experts = nn.ModuleDict({f"expert_{i}": nn.Sequential(nn.Linear(dim, 2 * dim), nn.ReLU(),
                                                                   nn.Linear(2 * dim, dim)) for i in range(experts)})

    def forward(self, ids):
        h = self.embed(ids)
        x = h.flatten(0, 1)
        self.router = self.router.to(torch.float32)
        weights, chosen = self.router(x).softmax(-1).max(dim=-1)
        out = torch.zeros_like(x)
        mask = torch.nn.functional.one_hot(chosen, len(self.experts)).T
        for expert in (mask.sum(-1) > 0).nonzero():
            token = torch.where(mask[expert[0]])[0]
            y = self.experts[f"expert_{expert[0]}"](x[token]) * weights[token, None]
            out.index_add_(0, token, y)
        return self.head(h + out.view_as(h))


class HitExperts(_ExpertsHit):
    """Experts in banks (``F.linear(x, W[e])``), run over the experts hit. ``extra``: each iteration also adds its
    expert's bias to every token, which is not a write of its tokens' rows (an expert with no token would still
    change the result). ``skips=False``: no check skips the mask's classes for no expert (``spare`` of them), whose
    ``W[e]`` is past the banks' end."""

    def __init__(self, dim: int = 32, experts: int = 4, k: int = TOP_K, extra: bool = False, skips: bool = True,
                 spare: int = 1):
        super().__init__(dim, experts, k, extra, skips=skips, spare=spare)
        self.up = nn.Parameter(torch.randn(experts, 2 * dim, dim) * 0.1)
        self.down = nn.Parameter(torch.randn(experts, dim, 2 * dim) * 0.1)
        self.bias = nn.Parameter(torch.randn(experts, dim) * 0.1)

    def expert(self, e, rows):
        up = nn.functional.linear(rows, self.up[e])
        return nn.functional.linear(torch.relu(up), self.down[e])


class GatedBankExperts(_ExpertsHit):
    """The OpenAI privacy filter's experts, run over the experts hit: ``rows.float() @ W[e].float()`` plus the
    expert's bias, gate and up side by side in one bank (cut apart by ``chunk``), GPT-OSS's clamped SwiGLU, then
    the down bank and its bias. Split, each rank holds matching gate and up columns of every expert. ``interleaved``:
    gate and up alternate along the bank's columns (GPT-OSS's ``[..., ::2]`` and ``[..., 1::2]``)."""

    def __init__(self, dim: int = 32, ffn: int = 32, experts: int = 4, k: int = TOP_K, interleaved: bool = False):
        super().__init__(dim, experts, k, vocab=models.VOCAB)
        self.interleaved = interleaved
        self.gate_up = nn.Parameter(torch.randn(experts, dim, 2 * ffn) * 0.1)
        self.gate_up_bias = nn.Parameter(torch.randn(experts, 2 * ffn) * 0.1)
        self.down = nn.Parameter(torch.randn(experts, ffn, dim) * 0.1)
        self.down_bias = nn.Parameter(torch.randn(experts, dim) * 0.1)

    def expert(self, e, rows):
        gate_up = rows.float() @ self.gate_up[e].float() + self.gate_up_bias[e].float()
        gate, up = (gate_up[..., ::2], gate_up[..., 1::2]) if self.interleaved else gate_up.chunk(2, dim=-1)
        gate, up = gate.clamp(max=7.0), up.clamp(-7.0, 7.0)
        return ((up + 1) * gate * torch.sigmoid(1.702 * gate)) @ self.down[e].float() + self.down_bias[e].float()


class FoldedBankExperts(_ExpertsHit):
    """DBRX's experts, run over the experts hit: each bank a 2-D parameter holding the experts' rows one after
    another, viewed as ``(experts, ffn, dim)`` and indexed per expert (``w1.view(-1, ffn, dim)[e]``); gate and up
    read through ``.T``. Split, each rank holds the same columns of every expert's block."""

    def __init__(self, dim: int = 32, ffn: int = 32, experts: int = 4, k: int = TOP_K):
        super().__init__(dim, experts, k, vocab=models.VOCAB)
        self.ffn = ffn
        self.w1, self.v1, self.w2 = (nn.Parameter(torch.randn(experts * ffn, dim) * 0.1) for _ in range(3))

    def expert(self, e, rows):
        w1, v1, w2 = (w.view(-1, self.ffn, w.shape[-1])[e] for w in (self.w1, self.v1, self.w2))
        return (nn.functional.silu(rows.matmul(w1.T)) * rows.matmul(v1.T)).matmul(w2)


BANK_LOOPS = {"privacy filter (gated bank)": GatedBankExperts, "dbrx (folded bank)": FoldedBankExperts}
"""Loops over the experts hit whose banks are indexed per expert (``W[e]``, ``W.view(E, F, D)[e]``)."""
BANKS = {"privacy filter (gated bank)": ("gate_up", "down"), "dbrx (folded bank)": ("w1", "v1", "w2")}
"""Their banks, which must be split."""


def _step_bytes(build, world: int) -> dict:
    """All-reduce bytes and counts of one forward and backward of ``build()`` at tp=``world``, vocabulary whole
    (so every all-reduce is the model's own layers')."""
    torch.manual_seed(0)
    model = build()
    ids = models.tokens(BATCH, SEQ, 1)
    pm = autotp.parallelize(model, tp=world, vocab="whole", example_inputs=(ids,))
    counted = count_step(lambda: pm(ids), lambda out: models.first_tensor(out).square().mean())
    return {d: counted[d].get("all_reduce", {"count": 0, "bytes": 0}) for d in ("forward", "backward")}


TRAINED_HERE = ("deepseek",)
"""The models whose training this worker checks. Mixtral's is ``tests/test_structures.py``'s "mixtral (expert
bank)" case, the same model and steps (``structures_workers.mixtral``): trained once in the suite. This DeepSeek
has experts in every layer, the structures' one a dense first layer."""


def moe(rank: int, world: int) -> dict:
    """For each MoE model: its training errors (``structures_workers.check_case``; TRAINED_HERE only) and its
    all-reduces next to its dense twin's."""
    out = {}
    for name, build in BUILDERS.items():
        out[name] = {"moe": _step_bytes(build, world), "dense": _step_bytes(lambda b=build: b(dense=True), world)}
        if name in TRAINED_HERE:
            case = CASES["deepseek_v3 (low-rank attention)"]
            out[name]["trained"] = check_case(name, structures_workers.Case(build, case.inputs, case.must_split), world)
    return out


def bank_loops(rank: int, world: int) -> dict:
    """Each loop over banks indexed per expert, trained (their all-reduces are test_moe's plan checks): a group of
    its own, so that neither test runs long."""
    return {name: {"trained": check_case(name, structures_workers.Case(build, _bank_ids, BANKS[name]), world)}
            for name, build in BANK_LOOPS.items()}


def _bank_ids(batch: int, seq: int, seed: int) -> tuple[torch.Tensor]:
    return (models.tokens(batch, seq, seed),)
