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

import contextlib
import re

from autotp.tools.model_spec import SMALL_HF, _small_low_rank

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
    "num_experts_per_token": 2, "moe_intermediate_size": 64, "n_shared_experts": 1, "num_shared_experts": 1,
    "shared_expert_intermediate_size": 64, "moe_num_experts": 4, "moe_k": 2, "moe_topk": 2, "top_k": 2,
    "expert_intermediate_size": 64, "moe_ffn_hidden_size": 64, "n_group": 1, "topk_group": 1,
    "num_expert_group": 1, "num_group": 1,
    # per-layer inputs and vocabularies besides the main one
    "hidden_size_per_layer_input": 16, "vocab_size_per_layer_input": 128,
    # state-space mixers
    "state_size": 16, "d_state": 16, "n_groups": 1, "mamba_d_state": 16, "mamba_n_heads": 8,
    "mamba_d_head": 16, "mamba_headdim": 16, "mamba_n_groups": 1, "ssm_state_size": 16, "chunk_size": 16,
    "time_step_rank": 8, "conv_kernel": 4,
    # vision towers: few small patches
    "image_size": 32, "patch_size": 8, "num_channels": 3,
    # audio front ends
    "num_mel_bins": 16, "max_source_positions": 32,
    # hashed n-gram vocabularies
    "encoder_hash_byte_group_vocab": 128,
}
"""Fields besides ``SMALL_HF``'s that size a model, shrunk where the architecture has them."""

MAX_PARAMS = 20_000_000
"""A tiny config must stay tiny: one that does not is not built (its size hides under fields no rule knows)."""


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


def shrink(fields: dict, sub_configs: dict | None = None, mixed: bool = True) -> dict:
    """The small values of a config's fields (only those it has), its sub-configs shrunk too. ``mixed``: per-layer
    lists keep one layer of each kind; else their first layers."""
    depth = _depth(fields)
    small = {k: v for k, v in (SMALL_HF | TINY_EXTRA).items() if k in fields and _shrinks(fields[k], v)}
    small |= _small_low_rank(fields, small)
    for name, value in fields.items():
        if isinstance(value, list) and depth and len(value) == depth and depth > LAYERS:
            small[name] = _fit_list(value, LAYERS) if mixed else value[:LAYERS]
        elif isinstance(value, list) and depth and _is_layer_indices(value, depth) and depth > LAYERS:
            kept = [v for v in value if v < LAYERS] or [LAYERS - 1]
            small[name] = kept
        elif isinstance(value, dict) and (name in (sub_configs or {}) or "model_type" in value):
            small[name] = value | shrink(value, mixed=mixed)
        elif isinstance(value, dict) and depth and value and all(str(k).isdigit() for k in value):
            small[name] = {k: v for k, v in value.items() if int(k) < LAYERS}  # settings keyed by layer index
        elif isinstance(value, dict) and value and all(isinstance(v, dict) for v in value.values()) \
                and any("head_dim" in v or "hidden_size" in v for v in value.values()):
            small[name] = {k: v | shrink(v) for k, v in value.items()}  # settings per kind of layer
        elif isinstance(value, int) and not isinstance(value, bool) and name.startswith("num_kv_shared"):
            small[name] = 0  # layers that reuse an earlier layer's keys and values: none of two layers
    vocab = small.get("vocab_size", fields.get("vocab_size"))
    if isinstance(vocab, int):  # special token ids of the full vocabulary would not fit the small one
        ids = [k for k in sorted(fields) if k.endswith(("_token_id", "_token_index", "_token_ids"))]
        small |= {k: vocab - 1 - i for i, k in enumerate(ids) if isinstance(fields[k], int) and fields[k] >= vocab}
    return small


def _shrinks(old, new) -> bool:
    """Whether a small value replaces a default: sizes only shrink, numbers replace numbers, and a size left
    unset (None: derived from others, such as ``head_dim``) is set."""
    if old is None:
        return True
    if isinstance(old, bool) or not isinstance(old, int):
        return False
    return new <= old and old != 0  # 0 switches a part off (no per-layer inputs): it stays off


TYPE_OVERRIDES = {
    "mamba2": {"num_heads": 8},  # hidden_size * expand must equal num_heads * head_dim
    "reformer": {"is_decoder": True},  # its LM head model asserts it
    "xmod": {"default_language": "en_XX"},  # its forward asks for a language adapter
    # its default text config fails its own validation (per-layer inputs and MoE must be off)
    "gemma4_assistant": {"text_config": {"hidden_size_per_layer_input": 0, "vocab_size_per_layer_input": 0,
                                         "enable_moe_block": False, "use_double_wide_mlp": False}},
}
"""Sizes that one architecture ties together in a way no general rule reads (its validation says which)."""

_REQUIRED = re.compile(r"\b(\w+) must (?:be|equal) (-?\d+|True|False|None)\b")
"""A validation message that states the one value a field may take (``hidden_size_per_layer_input must be
0, got 256``)."""


def tiny_config(model_type: str, overrides: dict | None = None):
    """The tiny config of ``model_type``, ``overrides`` applied last; transformers validates it. Where the
    validation names the one value a field must take, the field takes it and the config is made again."""
    import transformers

    fixed = TYPE_OVERRIDES.get(model_type, {})
    try:
        default = transformers.AutoConfig.for_model(model_type)
    except Exception:  # a default config that fails its own validation: with the fixes the table knows
        default = transformers.AutoConfig.for_model(model_type, **fixed)
    error = None
    for mixed in (True, False):  # some architectures validate only the kinds of layers their first layers have
        small = _merged(shrink(default.to_dict(), getattr(type(default), "sub_configs", None), mixed), fixed)
        try:
            return _validated(transformers, model_type, _merged(small, overrides or {}))
        except Exception as e:  # transformers and huggingface_hub raise many types for values a config rejects
            error = error or e
    raise error


def _validated(transformers, model_type: str, small: dict):
    """The config made from ``small``, fields its validation requires set as it says."""
    for _ in range(8):
        try:
            return transformers.AutoConfig.for_model(model_type, **small)
        except Exception as e:  # transformers and huggingface_hub raise many types for values a config rejects
            if not _apply_required(small, _messages(e)):
                raise
    return transformers.AutoConfig.for_model(model_type, **small)


def _merged(base: dict, extra: dict) -> dict:
    """``base`` with ``extra``'s values, sub-config dicts merged key by key."""
    out = dict(base)
    for key, value in extra.items():
        both = isinstance(value, dict) and isinstance(out.get(key), dict)
        out[key] = _merged(out[key], value) if both else value
    return out


def _messages(e: BaseException) -> str:
    out = []
    while e is not None:
        out.append(str(e))
        e = e.__cause__
    return " ".join(out)


def _apply_required(small: dict, message: str) -> bool:
    """Set the field a validation message requires (in the config or the sub-config that has it)."""
    match = _REQUIRED.search(message)
    if not match:
        return False
    name, text = match.groups()
    value = {"True": True, "False": False, "None": None}.get(text, None if text in ("True", "False", "None")
                                                              else int(text) if text.lstrip("-").isdigit() else text)
    if text == "None":
        value = None
    targets = [small] + [v for v in small.values() if isinstance(v, dict) and name in v]
    changed = False
    for target in targets:
        if (name in target or target is small and not targets[1:]) and target.get(name, object()) != value:
            target[name] = value
            changed = True
    return changed


@contextlib.contextmanager
def quiet():
    """transformers quiet while tiny models are built (their warnings concern full-size checkpoints)."""
    import transformers

    previous = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        yield
    finally:
        transformers.logging.set_verbosity(previous)
