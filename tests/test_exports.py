"""Exports of a plan to Hugging Face ``tp_plan`` and torch ``parallelize_module``: equal to HF's own plans
where HF has them, and honest (left out, with the reason) where the styles cannot say what the plan does."""

import pytest
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

import autotp
from autotp.tools.exports import Target, export_styles, to_hf_tp_plan, to_torch_plan, torch_plan_source, wildcard_styles
from tests import models

EXAMPLE = (models.tokens(2, 16, 0),)


def _plan(name: str, tp: int = 2):
    model = models.build(name)
    return model, autotp.plan(model, tp=tp, vocab="split", example_inputs=EXAMPLE)


@pytest.mark.parametrize("name", ["hf_llama", "hf_qwen2"])
def test_hf_export_equals_the_models_own_tp_plan(name):
    model, plan = _plan(name)
    exported = to_hf_tp_plan(plan)
    assert exported == model.tp_plan
    prefix = f"{model.base_model_prefix}."
    for layer, style in model.config.base_model_tp_plan.items():
        assert exported[prefix + layer] == style, layer


def test_torch_export_by_module_name():
    _, plan = _plan("llama")
    styles = to_torch_plan(plan)
    assert isinstance(styles["layers.0.attention.wq"], ColwiseParallel)
    assert isinstance(styles["layers.1.feed_forward.w2"], RowwiseParallel)
    embed, head = styles["tok_embeddings"], styles["output"]
    assert isinstance(embed, RowwiseParallel) and embed.input_layouts == (Replicate(),)
    assert isinstance(head, ColwiseParallel) and head.output_layouts == (Replicate(),)
    assert len(styles) == 2 * 7 + 2
    assert "ColwiseParallel(output_layouts=Replicate())" in torch_plan_source(plan)


def test_fused_qkv_is_left_out_whole_region_or_refused():
    _, plan = _plan("gpt")
    with pytest.raises(autotp.PlanError, match="fused weight of 3 parts"):
        to_torch_plan(plan)
    lenient = to_hf_tp_plan(plan, strict=False)
    assert lenient == {"transformer.wte": "embedding_rowwise", "transformer.h.*.mlp.c_fc": "colwise",
                       "transformer.h.*.mlp.c_proj": "rowwise", "lm_head": "colwise_gather_output"}
    skipped = export_styles(plan, Target.TORCH).skipped
    assert set(skipped) == {f"transformer.h.{i}.attn.{m}" for i in (0, 1) for m in ("c_attn", "c_proj")}


def test_transposed_and_bare_weights_are_not_expressible():
    _, gpt2 = _plan("hf_gpt2")
    assert "split along dim 1" in next(iter(export_styles(gpt2, Target.HF).skipped.values()))
    _, raw = _plan("raw_gpt")
    exported = export_styles(raw, Target.HF)
    assert exported.styles == {} and "bare parameter" in exported.skipped["embed"]


def test_kv_heads_kept_whole_leave_the_attention_out():
    _, plan = _plan("hf_llama", tp=4)  # 2 KV heads: tp=4 keeps K/V whole and slices heads per rank
    exported = export_styles(plan, Target.HF)
    assert "model.layers.0.self_attn.k_proj" in exported.skipped
    assert exported.styles["model.layers.0.mlp.down_proj"] == "rowwise"
    with pytest.raises(autotp.PlanError, match="KV heads"):
        to_hf_tp_plan(plan)


def test_wildcards_only_where_every_layer_agrees():
    modules = {"h.0.fc", "h.1.fc", "h.2.fc", "lm_head"}
    assert wildcard_styles({"h.0.fc": "colwise", "h.1.fc": "colwise", "h.2.fc": "colwise"}, modules) == {
        "h.*.fc": "colwise"}
    # h.2.fc stays whole: a pattern would shard it, so the layers are named one by one
    assert wildcard_styles({"h.0.fc": "colwise", "h.1.fc": "colwise"}, modules) == {
        "h.0.fc": "colwise", "h.1.fc": "colwise"}
