"""Tiny configs of transformers architectures, for the zoo: the same architecture at a size that builds in
seconds and checks in one process.

The default config of a model type is shrunk field by field (widths, depths, heads, vocabularies, experts),
then its own derived fields are made to agree: per-layer lists (``layer_types``, ``attention_layers``) follow
the new layer count, indices of layers (``hybrid_layer_ids``) drop the layers that no longer exist, and the
sub-configs of multimodal models (``text_config``, ``vision_config``, ``audio_config``...) shrink by the same
rules. The config class validates the result itself; a config that still will not build or stays large says
why in its own words.
"""

from __future__ import annotations

import re

from autotp.tools.model_spec import SMALL_HF, _small_low_rank
from devtools.tiny_overrides import TYPE_OVERRIDES
from devtools.tiny_repairs import repaired
from devtools.tiny_rotary import rotary_sections
from devtools.tiny_stages import (
    is_stage_list,
    small_stages,
    spelled_out_blocks,
    stage_kind,
)

LAYERS = 2
"""Layers of a tiny model: two, so a pattern of layer kinds (sliding and full attention, mixer and
attention) keeps one of each where the architecture has two kinds."""

DEPTH_FIELDS = ("num_hidden_layers", "num_layers", "n_layer", "n_layers", "encoder_layers", "decoder_layers",
                "num_decoder_layers", "num_encoder_layers", "depth", "num_hidden_layers_per_stage")
"""Fields that count layers (per-layer lists have this many entries)."""

TINY_EXTRA = {
    # widths and depths under other names
    "dim": 64, "embed_dim": 64, "hidden_dim": 128, "ffn_hidden_size": 128, "d_inner": 128, "inner_dim": 128,
    "n_inner": 128, "n_positions": 512, "encoder_ffn_dim": 128, "decoder_ffn_dim": 128, "text_hidden_size": 64,
    "projection_dim": 64, "proj_dim": 64, "projector_hidden_size": 64, "vision_hidden_size": 64,
    "n_layers": 2, "num_encoder_layers": 2, "num_global_layers": 1, "num_local_layers": 1,
    "depth": 2, "emb_dim": 64, "word_embed_proj_dim": 64, "embedding_size": 64, "qk_head_dim": 32,
    # mixture of experts: 4 experts, top-2
    "num_local_experts": 4, "num_experts": 4, "n_routed_experts": 4, "num_experts_per_tok": 2,
    "num_experts_per_token": 2, "top_k_experts": 2, "moe_intermediate_size": 64, "n_shared_experts": 1, "num_shared_experts": 1,
    "shared_expert_intermediate_size": 64, "moe_num_experts": 4, "moe_k": 2, "moe_topk": 2, "top_k": 2,
    "expert_intermediate_size": 64, "moe_ffn_hidden_size": 64, "n_group": 1, "topk_group": 1,
    "num_expert_group": 1, "num_group": 1, "zero_expert_num": 2,  # identity ("zero-computation") experts
    # per-layer inputs and vocabularies besides the main one
    "hidden_size_per_layer_input": 16, "vocab_size_per_layer_input": 128,
    # state-space mixers
    "state_size": 16, "d_state": 16, "n_groups": 1, "mamba_d_state": 16, "mamba_n_heads": 8,
    "mamba_d_head": 16, "mamba_headdim": 16, "mamba_n_groups": 1, "ssm_state_size": 16, "chunk_size": 16,
    "time_step_rank": 8, "conv_kernel": 4,
    # vision towers: few small patches
    "image_size": 32, "patch_size": 8, "window_size": 4,
    # audio front ends
    "num_mel_bins": 16, "max_source_positions": 32,
    # windows of local attention (the example's 32 tokens hold two)
    "attention_window": 16,
    # other vocabularies and latent arrays
    "encoder_hash_byte_group_vocab": 128, "entity_vocab_size": 128, "entity_emb_size": 64, "num_latents": 32,
    "d_latents": 64,
    # the output width of a vision tower (its merger's projection into the text model), or of an adapter of
    # images or audio into the text model
    "out_hidden_size": 64, "adapter_out_dim": 64,
    # the width of the global model, as the byte-level encoder and decoder that feed it name it
    "hidden_size_global": 64,
    # convolutional audio codecs (SEANet): the first layer's channels, doubled at each of the strided stages
    "num_filters": 8,
    # image autoencoders (VQ-GAN): the first stage's channels, multiplied per stage (32: their group norms have
    # 32 groups, a constant of the model)
    "base_channels": 32,
    # learned queries a Q-Former reads the image with (each a token of the text model's input)
    "num_query_tokens": 8, "latent_query_num": 8,
}
"""Fields besides ``SMALL_HF``'s that size a model, shrunk where the architecture has them."""

MAX_PARAMS = 20_000_000
"""A tiny config must stay tiny: one that does not is not built (its size hides under fields no rule knows)."""


_PLACEHOLDER = re.compile(r"(image|video|audio)_token_(id|index)$")
"""The token a multimodal model's forward finds its images' (or videos', audio's) places by; a config that leaves
it None (the processor sets it) gets one: with None, a forward given images finds no place for them."""


def _prefixed_sizes(fields: dict, small: dict) -> dict:
    """Sizes of one part of a multi-part config under its prefix (``speech_encoder_intermediate_size``,
    ``speech_encoder_layers``, ``t2u_encoder_ffn_dim``): the small value of the longest core size name (``SMALL_HF``)
    each ends with. Vocabularies excepted: token ids elsewhere index them."""
    # the core widths, depths and heads only: a prefixed chunk or window is tied to its part's strides
    table = {k: v for k, v in SMALL_HF.items() if "vocab" not in k}
    out = {}
    for name, value in fields.items():
        if name in small or name in table or not isinstance(value, int) or isinstance(value, bool):
            continue
        known = [k for k in table if name.endswith("_" + k)]
        if known and _shrinks(value, table[max(known, key=len)]):
            out[name] = table[max(known, key=len)]
    return out


def _depth(fields: dict) -> int | None:
    """The layer count of a config (its first depth field), before shrinking."""
    for name in DEPTH_FIELDS:
        if isinstance(fields.get(name), int) and fields[name] > 0:
            return fields[name]
    return None


def _fit_list(values: list, layers: int) -> list:
    """A per-layer list cut to ``layers`` entries, each kind of entry kept where there is room: the first
    layer of every kind, in order, then the first layers again."""
    firsts = sorted({repr(v): i for i, v in reversed(list(enumerate(values)))}.values())
    chosen = firsts[:layers]
    chosen += [i for i in range(len(values)) if i not in chosen][: layers - len(chosen)]
    return [values[i] for i in sorted(chosen)]


def _is_layer_indices(values: list, depth: int) -> bool:
    return bool(values) and all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v < depth for v in values) \
        and values == sorted(set(values))


def shrink(fields: dict, sub_configs: dict | None = None, mixed: bool = True, config_class=None) -> dict:
    """The small values of a config's fields (only those it has), its sub-configs shrunk too. ``mixed``: per-layer
    lists keep one layer of each kind; else their first layers. ``config_class``: the config's class (its
    sub-configs' classes are in ``sub_configs``), which says whether it takes multimodal rotary sections."""
    staged = any(is_stage_list(k, v) and stage_kind(k) == "depth" for k, v in fields.items())
    spelled = spelled_out_blocks(fields)
    depth = None if staged else _depth(fields)  # a hierarchical model's layer count counts its stages
    sizes = SMALL_HF | TINY_EXTRA
    small = {k: v for k, v in sizes.items() if k in fields and _shrinks(fields[k], v)}
    small |= _small_low_rank(fields, small)
    small |= _prefixed_sizes(fields, small)
    for name, value in fields.items():
        if name in sizes and isinstance(value, list) and depth and len(value) == depth \
                and all(isinstance(v, int) for v in value):
            small[name] = [min(v, sizes[name]) for v in value][:LAYERS]  # a size given per layer
        elif is_stage_list(name, value):
            if not spelled:  # blocks listed one by one (with their widths) tie the stages to them: kept
                small[name] = small_stages(name, value)
        elif name == "out_indices" and isinstance(value, list) and depth and depth > LAYERS:
            small[name] = [v for v in value if isinstance(v, int) and 0 <= v < LAYERS] or [LAYERS - 1]
        elif name == "out_features" and isinstance(value, list) and depth and depth > LAYERS:
            small[name] = None  # a backbone's outputs named after layers that no longer exist: its last
        elif isinstance(value, list) and depth and len(value) == depth and depth > LAYERS:
            small[name] = _fit_list(value, LAYERS) if mixed else value[:LAYERS]
            small[name] = _scaled_heads(name, small[name], fields, small)
        elif isinstance(value, list) and depth and _is_layer_indices(value, depth) and depth > LAYERS:
            kept = [v for v in value if v < LAYERS] or [LAYERS - 1]
            small[name] = kept
        elif isinstance(value, dict) and (name in (sub_configs or {}) or "model_type" in value):
            sub_class = _config_class(value, (sub_configs or {}).get(name))
            small[name] = value | shrink(value, mixed=mixed, config_class=sub_class)
        elif isinstance(value, dict) and depth and value and all(str(k).isdigit() for k in value):
            small[name] = {k: v for k, v in value.items() if int(k) < LAYERS}  # settings keyed by layer index
        elif isinstance(value, dict) and value and all(isinstance(v, dict) for v in value.values()) \
                and any("head_dim" in v or "hidden_size" in v for v in value.values()):
            small[name] = {k: v | shrink(v) for k, v in value.items()}  # settings per kind of layer
        elif isinstance(value, int) and not isinstance(value, bool) and name.startswith("num_kv_shared"):
            small[name] = 0  # layers that reuse an earlier layer's keys and values: none of two layers
    width = small.get("hidden_size")
    if isinstance(width, int):  # a group count equal to the width (a depthwise convolution) stays depthwise
        small |= {k: width for k, v in fields.items()
                  if k.endswith("groups") and isinstance(v, int) and v > width and v == fields.get("hidden_size")}
    stride, patch = fields.get("output_stride"), (fields | small).get("patch_size")
    if isinstance(small.get("image_size"), int) and isinstance(stride, int) and isinstance(patch, int):
        # the trunk divides the image by output_stride, and its last stage still folds patches: at least one
        small["image_size"] = max(small["image_size"], stride * patch)
    takes_sections = "mrope_section" in getattr(config_class, "ignore_keys_at_rope_validation", ())
    small |= rotary_sections(fields, small, takes_sections)
    text = small.get("text_config") if isinstance(small.get("text_config"), dict) else {}
    # a multimodal config's token ids (image, video, audio tokens) index its text model's vocabulary
    vocab = small.get("vocab_size", fields.get("vocab_size", text.get("vocab_size")))
    if isinstance(vocab, int):  # special token ids of the full vocabulary would not fit the small one
        ids = [k for k in sorted(fields) if k.endswith(("_token_id", "_token_index", "_token_ids"))]
        small |= {k: vocab - 1 - i for i, k in enumerate(ids) if isinstance(fields[k], int) and fields[k] >= vocab
                  or fields[k] is None and _PLACEHOLDER.search(k)}
    return small


def _scaled_heads(name: str, values: list, fields: dict, small: dict) -> list:
    """A per-layer list of head counts (Sapiens2's ``num_key_value_heads_per_layer``) scaled as the heads shrank:
    each layer's key-value heads must still divide the query heads; other lists as they are."""
    heads, fewer = fields.get("num_attention_heads"), small.get("num_attention_heads")
    if "heads" not in name or not isinstance(heads, int) or not isinstance(fewer, int) or fewer >= heads \
            or not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        return values
    return [max(1, v * fewer // heads) for v in values]


def _config_class(fields: dict, declared):
    """The config class of a sub-config: the one its ``model_type`` names where the parent declares only
    ``AutoConfig`` (whose class attributes say nothing of the model), else the declared one (None if neither)."""
    declared = declared if isinstance(declared, type) else None
    if (declared is None or declared.__name__ == "AutoConfig") and isinstance(fields.get("model_type"), str):
        from transformers import CONFIG_MAPPING

        # the lazy mapping's get() does not load the class: indexing does
        return CONFIG_MAPPING[fields["model_type"]] if fields["model_type"] in CONFIG_MAPPING else declared
    return declared


def _shrinks(old, new) -> bool:
    """Whether a small value replaces a default: sizes only shrink, numbers replace numbers, and a size left
    unset (None: derived from others, such as ``head_dim``) is set."""
    if old is None:
        return True
    if isinstance(old, bool) or not isinstance(old, int):
        return False
    return new <= old and old != 0  # 0 switches a part off (no per-layer inputs): it stays off


def tiny_model(model_type: str, build, overrides: dict | None = None):
    """``build(config)`` on the tiny config of ``model_type`` (``overrides`` applied last). Where the config's
    validation, or the model built from it, names the one value a field must take, the field takes it and
    both are made again; some architectures validate only the kinds of layers their first layers have, so a
    config with one layer of each kind falls back to the first layers'."""
    import transformers

    fixed = TYPE_OVERRIDES.get(model_type, {})
    default = default_config(model_type)
    fields = default.to_dict()
    error = None
    for mixed in (True, False):
        shrunk = shrink(fields, getattr(type(default), "sub_configs", None), mixed, type(default))
        for variant in _head_variants(fields, shrunk):
            small = _merged(_merged(variant, fixed), overrides or {})
            small = _rederived(model_type, small, default)
            try:
                return repaired(lambda: build(transformers.AutoConfig.for_model(model_type, **small)), small,
                                SMALL_HF | TINY_EXTRA, fields)
            except Exception as e:  # transformers and huggingface_hub raise many types for values a config rejects
                error = error or e
    raise error


def _head_variants(fields: dict, small: dict) -> list[dict]:
    """The shrunk fields ``small`` as they are (fewer key-value heads than heads: grouped-query attention, which
    the split of key-value heads must handle), then, if it differs, with as many key-value heads as heads wherever
    the default config has as many (``same_heads``): a model written for multi-head attention alone may not
    repeat its key-value heads (Moonshine views its queries by the key-value count)."""
    same = same_heads(fields, small)
    return [small, small | same] if same else [small]


def same_heads(fields: dict, small: dict) -> dict:
    """The key-value head counts of ``small`` (shrunk ``fields``, sub-configs included) set to its query heads' where
    the default ``fields`` have the two equal; {} if none changes. The query count of ``X_key_value_heads``
    (``encoder_num_key_value_heads``) is ``X_attention_heads`` beside it."""
    out = {}
    for name, value in fields.items():
        if isinstance(value, dict) and isinstance(small.get(name), dict):
            inner = same_heads(value, small[name])
            if inner:
                out[name] = small[name] | inner
        elif isinstance(name, str) and name.endswith("key_value_heads") and isinstance(value, int):
            heads = name[: -len("key_value_heads")] + "attention_heads"
            count = small.get(heads, fields.get(heads))
            if fields.get(heads) == value and isinstance(count, int) and small.get(name, value) != count:
                out[name] = count
    return out


def default_config(model_type: str):
    """The default config of ``model_type``; one that fails its own validation, with the fixes the table knows."""
    import transformers

    try:
        return transformers.AutoConfig.for_model(model_type)
    except Exception:  # any type: transformers and huggingface_hub raise several for a rejected value
        return transformers.AutoConfig.for_model(model_type, **TYPE_OVERRIDES.get(model_type, {}))


def _rederived(model_type: str, small: dict, default) -> dict:
    """``small`` less the prefixed sizes (``_prefixed_sizes``: a guess from the name) its config computes from the
    others (Zamba2's ``attention_hidden_size``, twice the width; MobileBERT's ``true_hidden_size``, its bottleneck's
    width): top-level fields the class does not declare that a config made without them still has. The default
    config was made from no fields, so it set them itself. Given, a guessed value would override the one the config
    derives from the shrunk sizes (and the model would mix the two); left out, the config derives it again.
    ``small`` as it is if that config fails."""
    import dataclasses

    import transformers

    cls = type(default)
    fields = default.to_dict()
    if not dataclasses.is_dataclass(cls):
        return small
    declared = {f.name for f in dataclasses.fields(cls)} | set(getattr(cls, "attribute_map", {}))
    guessed = _prefixed_sizes(fields, _small_low_rank(fields, {}))  # low-rank sizes have their own rule
    undeclared = [k for k in guessed if k in small and k not in declared]
    if not undeclared:
        return small
    try:
        made = transformers.AutoConfig.for_model(model_type, **{k: v for k, v in small.items() if k in declared})
    except Exception:  # any type: a config that needs the undeclared fields keeps them
        return small
    derived = {k for k in undeclared if hasattr(made, k)}
    return {k: v for k, v in small.items() if k not in derived}


def tiny_config(model_type: str, overrides: dict | None = None):
    """The tiny config of ``model_type`` (as ``tiny_model`` makes it, without building a model)."""
    return tiny_model(model_type, lambda config: config, overrides)


def _merged(base: dict, extra: dict) -> dict:
    """``base`` with ``extra``'s values, sub-config dicts merged key by key."""
    out = dict(base)
    for key, value in extra.items():
        both = isinstance(value, dict) and isinstance(out.get(key), dict)
        out[key] = _merged(out[key], value) if both else value
    return out


def quiet():
    """transformers quiet while tiny models are built (their warnings concern full-size checkpoints)."""
    import transformers

    from autotp.tools.model_spec import quiet_transformers

    return quiet_transformers(transformers)
