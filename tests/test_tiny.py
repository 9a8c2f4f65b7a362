"""The zoo's tiny-config builder (devtools/tiny.py): configs only, no model built, so these are fast."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402

from devtools.tiny import LAYERS, tiny_config, tiny_model  # noqa: E402


def test_per_layer_lists_follow_the_layer_count_and_keep_each_kind():
    config = tiny_config("gpt_neo")
    assert config.num_layers == LAYERS and len(config.attention_layers) == LAYERS
    assert set(config.attention_layers) == {"global", "local"}


def test_a_stack_of_sections_keeps_a_layer_in_each():
    """Dory's sections (run once, looped, run once) must sum to the depth: shrinking the depth alone left counts
    of 4, -7 and 4 over one layer (transformers 5.24 added it)."""
    import transformers

    if "dory" not in transformers.CONFIG_MAPPING:
        pytest.skip("this transformers has no dory (5.24 added it)")
    config = tiny_config("dory")
    sections = (config.n_input_layers, config.n_recurrent_layers, config.n_output_layers)
    assert sections == (1, 1, 1) and sum(sections) == config.num_hidden_layers == len(config.layer_types)


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


def test_early_stages_of_one_or_two_heads_get_four_so_tp_4_divides_them():
    config = tiny_config("pvt_v2")  # heads [1, 2, 5, 8] by default
    assert all(h % 4 == 0 and w % h == 0 for w, h in zip(config.hidden_sizes, config.num_attention_heads))


def test_key_value_heads_given_per_layer_shrink_with_the_heads():
    config = tiny_config("sapiens2")  # 16 heads, 16 or 8 key-value heads per layer by default
    assert all(config.num_attention_heads % kv == 0 for kv in config.num_key_value_heads_per_layer)


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
    from devtools.tiny import shrink

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


def test_rotary_sections_follow_a_partial_rotary_share_and_each_kind_of_layer():
    """Sections split the turned half of a head: a quarter of 16 wide heads turned (4), halved, is 2; settings per
    kind of layer are scaled kind by kind; none to scale, nothing changes."""
    from devtools.tiny import shrink

    one = {"rope_type": "default", "partial_rotary_factor": 0.25, "mrope_section": [8, 12, 12]}
    fields = {"hidden_size": 4096, "num_attention_heads": 32, "rope_parameters": {"full_attention": one}}
    assert sum(shrink(fields)["rope_parameters"]["full_attention"]["mrope_section"]) == 2
    assert "rope_parameters" not in shrink(fields | {"rope_parameters": {"full_attention": {"rope_theta": 1.0}}})
    assert "rope_parameters" not in shrink({"hidden_sizes": [64, 128], "num_attention_heads": [1, 2],
                                            "depths": [2, 2]})  # heads per stage: no single head width


def test_stage_lists_whose_widths_the_block_list_repeats_are_kept():
    """PP-LCNet lists each block with its widths: shrinking the per-stage widths alone would break the tie."""
    from devtools.tiny import shrink

    blocks = [[[3, 96, 96, 1]], [[3, 96, 192, 2], [3, 192, 192, 1]]]
    small = shrink({"stage_out_channels": [96, 192], "depths": [1, 2], "block_configs": blocks})
    assert "stage_out_channels" not in small and "depths" not in small
    assert shrink({"stage_out_channels": [96, 192], "depths": [1, 7]})["stage_out_channels"] == [24, 48]


def test_image_leaves_a_patch_after_the_trunk_stride_and_prefixed_part_sizes_shrink():
    from devtools.tiny import shrink

    assert shrink({"image_size": 256, "patch_size": 2, "output_stride": 32})["image_size"] == 64
    small = shrink({"hidden_size": 1024, "speech_encoder_intermediate_size": 4096, "speech_encoder_layers": 24,
                    "t2u_vocab_size": 10082})
    assert (small["speech_encoder_intermediate_size"], small["speech_encoder_layers"]) == (128, 2)
    assert "t2u_vocab_size" not in small  # a vocabulary other ids index: left as it is


def test_placeholder_tokens_index_the_text_vocabulary():
    """A multimodal config's image token (set, or None for the processor to set) fits its text model's
    vocabulary."""
    from devtools.tiny import shrink

    small = shrink({"image_token_index": None, "video_token_id": 151344, "pad_token_id": None,
                    "text_config": {"vocab_size": 151552, "model_type": "glm4v_text"}})
    assert small["image_token_index"] < 128 and small["video_token_id"] < 128 and "pad_token_id" not in small


def test_sizes_the_messages_tie_by_name_are_set_where_they_live():
    from autotp.tools.model_spec import SMALL_HF
    from devtools.tiny import TINY_EXTRA
    from devtools.tiny_repairs import apply_required

    sizes = SMALL_HF | TINY_EXTRA
    small = {"text_config": {"hidden_size": 64}, "audio_config": {"hidden_size": 32, "adapter_input_size": 1280}}
    assert apply_required(small, "ValueError: adapter_input_size must match hidden_size", sizes)
    assert small["audio_config"]["adapter_input_size"] == 32 and "adapter_input_size" not in small["text_config"]
    small = {"head_dim": 16, "qk_nope_head_dim": 16, "qk_rope_head_dim": 16}
    assert apply_required(small, "SWA head_dim must equal qk_nope_head_dim + qk_rope_head_dim", sizes)
    assert small["head_dim"] == 32
    small = {"num_attention_heads": 4, "encoder_config": {"num_key_value_heads": 2}}
    assert apply_required(small, "AttributeError: 'MoonshineStreamingConfig' object has no attribute "
                                 "'num_key_value_heads'", sizes)
    assert small["num_key_value_heads"] == 4  # a config without key-value heads has one per attention head


def test_a_low_rank_size_of_zero_stays_zero():
    """glm5_next's NoPE layers: ``qk_rope_head_dim=0`` must not become a rotary part."""
    from devtools.tiny import shrink

    small = shrink({"kv_lora_rank": 512, "qk_rope_head_dim": 0, "qk_nope_head_dim": 256, "hidden_size": 4096})
    assert small.get("qk_rope_head_dim", 0) == 0


def _on_meta(cls):
    """A build function for ``tiny_model``: ``cls`` made on the meta device from the part of the config it takes."""
    from devtools.zoo_entries import config_of

    def build(config):
        config = config_of(cls, config)
        with torch.device("meta"):
            cls(config)
        return config

    return build


@pytest.mark.parametrize("model_type, class_name, part", [("qwen3_5", "Qwen3_5ForCausalLM", "text_config"),
                                                         ("musicgen", "MusicgenForCausalLM", "decoder")])
def test_a_causal_lm_of_a_composite_type_takes_its_own_config_class_part(model_type, class_name, part):
    """The causal-LM mapping names a multimodal (or encoder-decoder) type whose causal LM takes one sub-config: the
    one of its class's ``config_class`` (the text model's; MusicGen's decoder, beside a text encoder that is a text
    config too)."""
    import transformers

    cls = getattr(transformers, class_name)
    config = tiny_model(model_type, _on_meta(cls))
    assert type(config) is cls.config_class
    assert config.to_dict() == getattr(tiny_config(model_type), part).to_dict()


def test_a_field_a_sub_config_does_not_declare_takes_the_value_another_part_holds():
    """DBRX's attention reads ``attn_config.rope_theta``, which its config keeps in ``rope_parameters``."""
    import transformers

    config = tiny_model("dbrx", _on_meta(transformers.DbrxForCausalLM))
    assert config.attn_config.rope_theta == config.rope_parameters["rope_theta"]


def test_sizes_the_config_derives_from_the_width_are_left_to_it():
    """Zamba2 computes ``attention_hidden_size`` (twice the width) itself: a size guessed from its name
    (``*_hidden_size``) would override it and the shared attention block would mix the two widths."""
    config = tiny_config("zamba2")
    assert config.attention_hidden_size == 2 * config.hidden_size
    assert config.attention_head_dim == config.attention_hidden_size // config.num_attention_heads


def test_a_size_given_per_layer_shrinks_under_any_size_name():
    """Gemma 3n lists ``intermediate_size`` per layer."""
    assert tiny_config("gemma3n_text").intermediate_size == [128] * LAYERS
    from devtools.tiny import shrink

    assert shrink({"num_hidden_layers": 4, "intermediate_size": [512, 512, 1024, 1024]})["intermediate_size"] == \
        [128, 128]


def test_an_adapter_into_the_text_model_takes_the_text_width():
    """Dots 3 Note's vision and audio adapters project into the text model: their output widths follow it."""
    config = tiny_config("dots3_note")
    assert config.vision_config.adapter_out_dim == config.audio_config.adapter_out_dim == config.text_config.hidden_size


def test_layer_indices_a_validation_finds_past_the_tiny_tower_move_into_it_in_order():
    """molmo2's validation says ``adapter_config.vision_feature_layer [24, 18] must index the 2 layers of
    vision_config``: the deepest index becomes the last layer, the next the one below."""
    from devtools.tiny_repairs import apply_required

    small = {"adapter_config": {}}
    message = "`adapter_config.vision_feature_layer` [24, 18] must index the 2 layers of `vision_config`."
    assert apply_required(small, message, {}) and small["adapter_config"]["vision_feature_layer"] == [1, 0]
    config = tiny_config("molmo2")
    assert config.adapter_config.vision_feature_layer == [1, 0] and config.vision_config.num_hidden_layers == 2


def test_a_layer_count_that_counts_per_stage_lists_takes_their_length_where_they_are():
    """muse_spark's audio tower says ``patch_sizes, hidden_sizes and depths must have one entry per layer, got 4, 4
    and 4 for num_hidden_layers=2``: the count is set in the sub-config holding the lists, not the text model's."""
    from devtools.tiny_repairs import apply_required

    small = {"text_config": {"num_hidden_layers": 2}, "audio_config": {"depths": [2, 2, 2, 2], "num_hidden_layers": 2}}
    message = ("`patch_sizes`, `hidden_sizes` and `depths` must have one entry per layer, got 4, 4 and 4 for "
               "`num_hidden_layers`=2.")
    assert apply_required(small, message, {})
    assert small == {"text_config": {"num_hidden_layers": 2}, "audio_config": {"depths": [2, 2, 2, 2],
                                                                              "num_hidden_layers": 4}}


def test_key_value_heads_as_many_as_heads_where_the_default_has_as_many():
    """The fallback for a model written for multi-head attention alone (Moonshine views its queries by the
    key-value count): key-value heads follow the query heads where the default config has the two equal, under any
    prefix and in sub-configs; grouped-query defaults keep their fewer key-value heads."""
    from devtools.tiny import same_heads

    fields = {"encoder_num_attention_heads": 8, "encoder_num_key_value_heads": 8, "num_attention_heads": 32,
              "num_key_value_heads": 8, "text_config": {"model_type": "t", "num_attention_heads": 16,
                                                        "num_key_value_heads": 16}}
    small = {"encoder_num_attention_heads": 4, "encoder_num_key_value_heads": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "text_config": {"model_type": "t", "num_attention_heads": 4,
                                                       "num_key_value_heads": 2}}
    assert same_heads(fields, small) == {"encoder_num_key_value_heads": 4, "text_config": {
        "model_type": "t", "num_attention_heads": 4, "num_key_value_heads": 4}}
    assert same_heads(fields, small | same_heads(fields, small)) == {}  # once equal, nothing changes


def test_a_tiny_model_that_builds_only_with_as_many_key_value_heads_as_heads_gets_them():
    """A build that refuses fewer key-value heads than heads (as a model that does not repeat them fails to run)
    gets the multi-head variant of the tiny config."""
    def build(config):
        if config.encoder_num_key_value_heads != config.encoder_num_attention_heads:
            raise RuntimeError("shape '[2, 9, 2, 16]' is invalid for input of size 1152")
        return config

    config = tiny_model("moonshine", build)
    assert config.encoder_num_key_value_heads == config.encoder_num_attention_heads == 4
    assert config.decoder_num_key_value_heads == config.decoder_num_attention_heads
