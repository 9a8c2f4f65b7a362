"""Attention split by heads wherever heads are independent (issue 25): a per-head norm between the projections
and a concatenation of two streams (SD3 with QK norm, Flux's dual- and single-stream blocks), and DeBERTa-v2's
disentangled attention (a per-head position table repeated over the batch, scores picked per head by ``gather``),
WavLM's gated relative position bias (a per-head gate computed by a small linear the heads share), and BEiT's
relative-position bias (a per-head table resized to the image's grid by ``interpolate``).
Each is checked exact in one process; the forward all-reduces are counted against Megatron's: one per output
projection of each stream's attention and MLP."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

import autotp
from devtools.zoo_diffusers import MODELS


def _forward_all_reduces(plan: autotp.Plan) -> Counter:
    """Forward all-reduces per block (``transformer_blocks.0``), or per top-level module outside blocks."""
    out = Counter()
    for c in plan.collectives:
        if c.op.value == "all_reduce" and c.direction.value == "forward":
            parts = c.module.split(".")
            out[".".join(parts[:2]) if parts[0].endswith("blocks") else parts[0]] += 1
    return out


def _diffusers(name: str):
    pytest.importorskip("diffusers")
    build, inputs = MODELS[name]
    torch.manual_seed(0)
    model = build()
    return model, inputs(model)


def test_sd3_with_qk_norm_splits_joint_attention_by_heads():
    model, inputs = _diffusers("SD3Transformer2DModel:qk_norm")
    report = autotp.check(model, 2, inputs)
    assert report.exact, report
    split = {n for n, p in report.plan.placements.items() if p.is_split}
    for layer in ("to_q", "add_q_proj", "add_k_proj", "to_out.0", "to_add_out"):
        assert f"transformer_blocks.0.attn.{layer}.weight" in split, layer
    counts = _forward_all_reduces(report.plan)
    # Megatron: each stream's attention output and MLP (4), plus the two modulation projections split alone
    assert counts["transformer_blocks.0"] == 4 + 2, counts
    # the last block keeps only the image stream's outputs (context_pre_only): attention and MLP, plus modulation
    assert counts["transformer_blocks.1"] == 2 + 2, counts


def test_flux_blocks_all_reduce_as_megatron_does():
    model, inputs = _diffusers("FluxTransformer2DModel")
    report = autotp.check(model, 2, inputs)
    assert report.exact, report
    split = {n for n, p in report.plan.placements.items() if p.is_split}
    assert {"single_transformer_blocks.0.attn.to_q.weight", "single_transformer_blocks.0.proj_mlp.weight",
            "single_transformer_blocks.0.proj_out.weight", "transformer_blocks.0.attn.add_k_proj.weight"} <= split
    # the single-stream block's output projection reads attention heads beside MLP channels: a row in segments
    assert report.plan.placements["single_transformer_blocks.0.proj_out.weight"].segments == (64, 256)
    counts = _forward_all_reduces(report.plan)
    assert counts["transformer_blocks.0"] == 4 + 2, counts  # two streams' attention and MLP, two modulations
    assert counts["single_transformer_blocks.0"] == 1 + 1, counts  # one fused output projection, one modulation


def _deberta_v2():
    transformers = pytest.importorskip("transformers")
    from devtools.tiny import tiny_config

    config = tiny_config("deberta-v2", dict(relative_attention=True, pos_att_type=["p2c", "c2p"], position_buckets=8,
                                            max_relative_positions=-1, hidden_dropout_prob=0.0,
                                            attention_probs_dropout_prob=0.0))
    torch.manual_seed(0)
    return transformers.DebertaV2ForMaskedLM(config), torch.randint(0, config.vocab_size, (2, 16))


def test_deberta_v2_disentangled_attention_is_split_by_heads():
    model, ids = _deberta_v2()
    report = autotp.check(model, 2, (ids,), vocab="split")
    assert report.exact, report
    split = {n for n, p in report.plan.placements.items() if p.is_split}
    for layer in ("query_proj", "key_proj", "value_proj", "pos_key_proj", "pos_query_proj"):
        assert f"deberta.encoder.layer.0.attention.self.{layer}.weight" in split, layer
    assert "deberta.encoder.layer.0.attention.output.dense.weight" in split


def _beit(shared: bool):
    """BEiT with a relative-position bias per layer (or one, ``shared``, for every layer): a table with a column
    per head, resized to the image's grid (``interpolate``), joined with the class token's rows, picked per
    position and added to the scores."""
    transformers = pytest.importorskip("transformers")
    config = transformers.BeitConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                                     image_size=16, patch_size=4, num_labels=10, drop_path_rate=0.0,
                                     **{"use_shared_relative_position_bias" if shared else
                                        "use_relative_position_bias": True})
    torch.manual_seed(0)
    return transformers.BeitForImageClassification(config), (torch.randn(2, 3, 16, 16),)


@pytest.mark.parametrize("shared", [False, True])
def test_beit_relative_position_bias_is_split_with_the_heads(shared):
    model, inputs = _beit(shared)
    report = autotp.check(model, 2, inputs)
    assert report.exact, report
    placements = report.plan.placements
    for layer in (0, 1):
        for name in ("q_proj", "k_proj", "v_proj"):
            assert placements[f"beit.layers.{layer}.attention.{name}.weight"].kind.value == "colwise", (layer, name)
        assert placements[f"beit.layers.{layer}.attention.o_proj.weight"].kind.value == "rowwise"
    tables = [n for n in placements if n.endswith("relative_position_bias_table")]
    assert len(tables) == (1 if shared else 2) and all(placements[n].is_split for n in tables), tables


class GatedBiasAttention(torch.nn.Module):
    """WavLM's attention, hand-written: a per-head relative position bias (a table of one column per head) scaled by
    a per-head gate that one small linear, shared by the heads, computes from each head's slice of the input (or of
    the queries, ``gate_from="query"``). With ``joined_biases``, the attention is torch's
    ``multi_head_attention_forward`` given separate Q/K/V weights, which joins their biases and chunks them again."""

    def __init__(self, width: int = 64, heads: int = 4, gate_from: str = "input", joined_biases: bool = True):
        super().__init__()
        self.heads, self.gate_from, self.joined_biases = heads, gate_from, joined_biases
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (torch.nn.Linear(width, width) for _ in range(4))
        self.gate = torch.nn.Linear(width // heads, 8)
        self.gate_const = torch.nn.Parameter(torch.ones(1, heads, 1, 1))
        self.table = torch.nn.Embedding(16, heads)
        self.head = torch.nn.Linear(width, 8)

    def forward(self, x):
        b, t, width = x.shape
        h = self.heads
        positions = torch.arange(t)
        buckets = (positions[None, :] - positions[:, None]).clamp(-7, 8) + 7
        bias = self.table(buckets).permute(2, 0, 1)[None].repeat(b, 1, 1, 1)  # [b, h, t, t]
        source = self.q_proj(x) if self.gate_from == "query" else x
        gate = self.gate(source.view(b, t, h, -1).transpose(1, 2)).view(b, h, t, 2, 4).sum(-1)
        gate_a, gate_b = torch.sigmoid(gate).chunk(2, dim=-1)
        bias = (gate_a * (gate_b * self.gate_const - 1.0) + 2.0) * bias
        if self.joined_biases:
            out, _ = torch.nn.functional.multi_head_attention_forward(
                x.transpose(0, 1), x.transpose(0, 1), x.transpose(0, 1), width, h, torch.empty([0]),
                torch.cat((self.q_proj.bias, self.k_proj.bias, self.v_proj.bias)), None, None, False, 0.0,
                self.out_proj.weight, self.out_proj.bias, training=self.training, need_weights=False,
                attn_mask=bias.reshape(b * h, t, t), use_separate_proj_weight=True, q_proj_weight=self.q_proj.weight,
                k_proj_weight=self.k_proj.weight, v_proj_weight=self.v_proj.weight)
            out = out.transpose(0, 1)
        else:
            q, k, v = (p(x).view(b, t, h, -1).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
            scores = torch.softmax(q @ k.transpose(-1, -2) / 4.0 + bias, dim=-1)
            out = self.out_proj((scores @ v).transpose(1, 2).reshape(b, t, width))
        return self.head(x + out)


@pytest.mark.parametrize("gate_from, joined_biases", [("input", True), ("query", False)])
def test_a_gated_relative_position_bias_follows_the_head_split(gate_from, joined_biases):
    """The gate is per head: the attention splits by heads, with the bias table's and the gate constant's heads;
    the gate's small linear, shared by the heads, is kept whole (each rank computes its heads' gates). Q/K/V whose
    biases torch joins and chunks again are projections all the same."""
    torch.manual_seed(0)
    model = GatedBiasAttention(gate_from=gate_from, joined_biases=joined_biases)
    report = autotp.check(model, 2, (torch.randn(2, 12, 64),))
    assert report.exact, report
    placements = report.plan.placements
    for name in ("q_proj.weight", "q_proj.bias", "k_proj.weight", "v_proj.weight"):
        assert placements[name].kind.value == "colwise", (name, placements[name])
    assert placements["out_proj.weight"].kind.value == "rowwise"
    assert placements["table.weight"].is_split and placements["gate_const"].is_split
    assert placements["gate.weight"].kind.value != "colwise"


def test_head_split_attention_trains_exactly_on_two_gloo_ranks():
    """SD3 and Flux where diffusers is installed; DeBERTa-v2 and BEiT always."""
    from tests import attention_workers
    from tests.distributed import run_on_ranks

    results = run_on_ranks(attention_workers.heads, 2)
    for rank in results:
        for name, r in rank.items():
            assert r["output"] < 1e-5 and max(r["losses"]) < 1e-5 and r["params"] < 1e-5, (name, r)
    if "FluxTransformer2DModel" in results[0]:
        assert {"single_transformer_blocks.0.proj_out.weight",
                "transformer_blocks.0.attn.add_q_proj.weight"} <= set(results[0]["FluxTransformer2DModel"]["split"])
    assert "deberta.encoder.layer.0.attention.self.pos_key_proj.weight" in results[0]["deberta-v2"]["split"]
    assert "beit.layers.1.relative_position_bias.relative_position_bias_table" in results[0]["beit"]["split"]
    assert results[0] == results[1] or all(results[0][n]["split"] == results[1][n]["split"] for n in results[0])
