"""Per-architecture values of the zoo's tiny configs (``devtools.tiny``): sizes one architecture ties together
in a way no general rule reads, and defaults of a model's config that do not build or run. Type names appear only
here and in the zoo's other tables, never in autotp's logic.
"""

TYPE_OVERRIDES = {
    "mamba2": {"num_heads": 8},  # hidden_size * expand must equal num_heads * head_dim
    "xmod": {"default_language": "en_XX"},  # its forward asks for a language adapter
    # every stage's resolution at least the window (16, 8, 4, 2 patches across): the relative-position tables
    # are made for the configured window
    **{t: {"image_size": 64, "patch_size": 4, "window_size": 2}
       for t in ("swin", "swinv2", "donut-swin", "maskformer-swin")},
    # each stage reads its layers' drop-path rates at the stage's index (not the layer's): stage i needs more than
    # i layers
    "cvt": {"depth": [1, 2, 3]},
    "esm": {"pad_token_id": 1, "mask_token_id": 32},
    # its stem is four stride-2 convolutions (16 pixels a patch whatever patch_size says), and patch_size sizes the
    # attention biases: it stays 16, with four patches across
    "levit": {"patch_size": 16, "image_size": 64},
    # the config carries the tokenizer's vocabulary (None by default), where the model looks up its image tokens
    # by name: those it reads, at the top of the small vocabulary
    "chameleon": {"vocabulary_map": {"<image>": 127}},
    "emu3": {"vocabulary_map": {"<image>": 127, "<|extra_200|>": 126}},
    # its default config leaves the kinds of MLP per layer None, which the model indexes by layer: a dense first
    # layer and a mixture of experts, as DeepSeek's models start
    "deepseek_ocr2": {"text_config": {"mlp_layer_types": ["dense", "sparse"]}},
    # its default config leaves the kinds of layer None, which the model indexes by layer: a short convolution and
    # an attention layer, as its released configs interleave them; one dense MLP first (two by default), then experts
    "lfm2_moe": {"layer_types": ["conv", "full_attention"], "num_dense_layers": 1},
    # its default leaves the clipping of queries, keys and values None, which the forward passes to clamp as both
    # bounds (a crash): the released model clips at 8
    "dbrx": {"attn_config": {"clip_qkv": 8}},
    # its vision tower is timm's MobileNet-V5 (300M parameters), whose widths no config field sets: timm's builder
    # takes a width multiplier, which the config passes on (``model_args``)
    "gemma3n": {"vision_config": {"model_args": {"channel_multiplier": 0.1}}},
    # its model reads the ids of the yes and no tokens from fields its config does not declare, by default ids of
    # the full vocabulary
    "shieldgemma2": {"yes_token_index": 126, "no_token_index": 125},
    # its vocabulary holds the image tokenizer's codebook and then the audio codec's, each range starting at an
    # offset the config sets (the first ending where the second starts): both codebooks small, side by side in the
    # small vocabulary, below its special tokens
    "apertus1p5": {"vision_config": {"codebook_size": 32}, "audio_config": {"codebook_size": 32},
                   "image_token_offset": 32, "audio_token_offset": 64},
    # the last convolution's width is the model's constant 1280 scaled by width_coefficient, and hidden_dim must
    # equal it (its batch norm): a tenth of 1280 is the tiny width
    "efficientnet": {"width_coefficient": 0.1, "hidden_dim": 128},
    # windowed attention over the patch grid: the window count a square that divides the tiny image's grid
    "lw_detr_vit": {"num_windows": 4},
    # a token's layout embedding is its box's four coordinates and two sides side by side: the width six parts
    "layoutlmv3": {"hidden_size": 96, "coordinate_size": 16, "shape_size": 16},
    "lilt": {"hidden_size": 96},  # its default config has no padding id, which it needs
    # the axial position table factors the hidden size and the sequence (32 tokens), chunks divide it
    "reformer": {"axial_pos_embds_dim": [32, 32], "axial_pos_shape": [4, 8], "local_attn_chunk_length": 16,
                 "lsh_attn_chunk_length": 16},
    # its default text config fails its own validation (per-layer inputs and MoE must be off)
    "gemma4_assistant": {"text_config": {"hidden_size_per_layer_input": 0, "vocab_size_per_layer_input": 0,
                                         "enable_moe_block": False, "use_double_wide_mlp": False}},
    # its stack is three sections (layers run once, layers looped n_recurrent_loops times, layers run once) whose
    # counts must sum to the depth, and its config counts an attention block and an MLP block as two layers (halved
    # on loading): one layer per section, so the looped section exists and is looped
    "dory": {"num_hidden_layers": 6, "n_input_layers": 2, "n_recurrent_layers": 2, "n_output_layers": 2,
             "layer_types": ["sliding_attention", "mlp", "sliding_attention", "mlp", "full_attention", "mlp"]},
    # its rotary embedding reads sections the default config does not set, defaulting to those of the full head
    # (16 + 24 + 24 of 64 rotary pairs): the tiny head's 8 pairs in the same proportions
    "paddleocr_vl": {"text_config": {"rope_parameters": {"rope_type": "default", "rope_theta": 500000.0,
                                                         "mrope_section": [2, 3, 3]}}},
    # timm's own models by name: the defaults (ResNet-50 and none) are not small; timm ships tiny test models of
    # the same families (its ``test_*`` registry entries), which the wrapper builds as it would a released one
    "timm_wrapper": {"architecture": "test_vit"},
    "timm_backbone": {"backbone": "test_resnet"},
    # vision towers that are timm models: FastVLM's hybrid FastViT (123M) reads the tower's last feature map, as
    # wide as the config's hidden size; Perception LM's (a ResNet-50 by default, where the model needs a ViT with
    # a class token and its width in model_args)
    "fast_vlm": {"vision_config": {"architecture": "test_resnet", "model_args": None, "hidden_size": 96}},
    # its default config leaves the Window Q-Former's rate and the vision-to-decoder layer map None, which the
    # model reads (the released configs set them): windows of 2 patches pooled to 1 query, the last vision
    # layer feeding the first decoder layer, the spatial groups on the tiny decoder's layers
    "granite4_vision": {"downsample_rate": "1/2", "deepstack_layer_map": [[-1, 0]], "spatial_target_layers": [0, 1, 0, 1]},
    # its vision adapter shuffles 2 x 2 patches into one (pixel_shuffle_ratio 0.5) before a projection as wide as
    # the vision MLP's intermediate size: the released config ties that to 4 x the hidden size; the projector's
    # widths (4096 by default) feed the text projection, which reads vision_output_dim
    "llama4": {"vision_config": {"intermediate_size": 256, "projector_input_dim": 64, "projector_output_dim": 64,
                                 "vision_output_dim": 64}},
    # its decoder's layer kinds include sliding-window attention where its default config sets no window
    "step3p7": {"text_config": {"sliding_window": 16}},
    "perception_lm": {"vision_config": {"architecture": "test_vit", "model_args": {"embed_dim": 64}}},
    # its acoustic tokenizers' stages double a filter count seven times, with depths no rule shrinks (lists): one
    # block a stage, from 4 filters
    "vibevoice": {"audio_config": {"depths": [1] * 7, "num_filters": 4},
                  "semantic_model_config": {"depths": [1] * 7, "num_filters": 4}},
}
"""Sizes that one architecture ties together in a way no general rule reads (its validation says which)."""
