"""Attention split by heads wherever heads are independent (issue 25): a per-head norm between the projections
and a concatenation of two streams (SD3 with QK norm, Flux's dual- and single-stream blocks), and DeBERTa-v2's
disentangled attention (a per-head position table repeated over the batch, scores picked per head by ``gather``).
Each is checked exact in one process; the forward all-reduces are counted against Megatron's: one per output
projection of each stream's attention and MLP."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

import autotp
from autotp.tools.zoo_diffusers import MODELS


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
    from autotp.tools.tiny import tiny_config

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


def test_head_split_attention_trains_exactly_on_two_gloo_ranks():
    pytest.importorskip("diffusers")
    from tests import attention_workers
    from tests.distributed import run_on_ranks

    results = run_on_ranks(attention_workers.heads, 2)
    for rank in results:
        for name, r in rank.items():
            assert r["output"] < 1e-5 and max(r["losses"]) < 1e-5 and r["params"] < 1e-5, (name, r)
    assert {"single_transformer_blocks.0.proj_out.weight",
            "transformer_blocks.0.attn.add_q_proj.weight"} <= set(results[0]["FluxTransformer2DModel"]["split"])
    assert "deberta.encoder.layer.0.attention.self.pos_key_proj.weight" in results[0]["deberta-v2"]["split"]
    assert results[0] == results[1] or all(results[0][n]["split"] == results[1][n]["split"] for n in results[0])
