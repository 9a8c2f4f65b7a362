"""The zoo's tiny-config builder (autotp/tools/tiny.py): configs only, no model built, so these are fast."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402

from autotp.tools.tiny import LAYERS, tiny_config, tiny_model  # noqa: E402


def test_per_layer_lists_follow_the_layer_count_and_keep_each_kind():
    config = tiny_config("gpt_neo")
    assert config.num_layers == LAYERS and len(config.attention_layers) == LAYERS
    assert set(config.attention_layers) == {"global", "local"}


def test_sub_configs_of_a_multimodal_model_shrink_too():
    config = tiny_config("gemma3")
    text, vision = config.text_config, config.vision_config
    assert (text.hidden_size, text.num_hidden_layers, vision.hidden_size, vision.num_hidden_layers) == (64, 2, 64, 2)
    assert len(text.layer_types) == 2 and set(text.layer_types) == {"sliding_attention", "full_attention"}


def test_settings_keyed_by_layer_drop_the_layers_that_no_longer_exist():
    config = tiny_config("gemma4_text")  # its defaults set layers 5, 11, 17, 23 and 29 apart
    assert len(config.layer_types) == LAYERS
    assert all(int(k) < LAYERS for k in config.to_dict().get("per_layer_config") or {})


def test_a_value_the_validation_requires_is_taken_from_its_message():
    """gemma4_assistant's validation says ``hidden_size_per_layer_input must be 0``."""
    assert tiny_config("gemma4_assistant").text_config.hidden_size_per_layer_input == 0


def test_stages_of_a_hierarchical_model_shrink_and_keep_heads_dividing_widths():
    config = tiny_config("swin")
    assert len(config.depths) == 4 and max(config.depths) <= 2
    widths = [config.embed_dim * 2 ** i for i in range(len(config.depths))]
    assert all(w % h == 0 and h % 2 == 0 for w, h in zip(widths, config.num_heads))


def test_layer_indices_keep_only_layers_that_exist():
    config = tiny_config("zamba2")
    assert all(i < LAYERS for i in getattr(config, "hybrid_layer_ids", []) or [])


def test_a_group_count_the_shrunk_channels_must_divide_follows_the_message():
    """bit's group norms say ``num_channels (16) must be divisible by num_groups (32)`` once widths shrink."""
    import transformers

    def on_meta(config):
        with torch.device("meta"):
            transformers.BitModel(config)
        return config

    config = tiny_model("bit", on_meta)
    assert config.num_groups < 32 and all(w % config.num_groups == 0 for w in config.hidden_sizes)


def test_a_value_the_validation_states_as_an_expression_is_taken_from_its_message():
    """fun_asr_nano's validation says ``adaptor_config.intermediate_size (128) must equal
    `text_config.hidden_size // 4` (16)``: the value in parentheses is the one the field takes."""
    config = tiny_config("fun_asr_nano")
    assert config.adaptor_config.intermediate_size == config.text_config.hidden_size // 4


def test_a_depthwise_group_count_follows_the_width_and_channel_counts_stay():
    """A group count equal to the width (Mimi's depthwise upsampling) shrinks with it; ``num_channels`` is not
    a width (Dia's nine audio codebooks, which its delay pattern lists one by one)."""
    from autotp.tools.tiny import shrink

    small = shrink({"hidden_size": 512, "upsample_groups": 512, "num_groups": 32, "num_channels": 9})
    assert small["upsample_groups"] == small["hidden_size"] == 64
    assert "num_groups" not in small and "num_channels" not in small


@pytest.mark.parametrize("model_type", ["qwen2_vl", "cosmos3_edge"])
def test_multimodal_rotary_sections_fit_the_shrunk_head(model_type):
    """Sections sized for the full head, in the config (cosmos3_edge) or in the model's code (qwen2_vl, whose
    config class declares it takes them), are made to fill the tiny head's rotary half."""
    text = tiny_config(model_type).text_config
    head = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    assert sum(text.rope_parameters["mrope_section"]) == head // 2
