"""The zoo's population: every model class of transformers' task mappings people train or run, grouped by
task, diffusers' transformers and timm's ViT family when those are installed, torch's own, and the examples.

Each group names the transformers mapping it reads (whose classes build its models) and the inputs it is fed.
Type names appear only in the tables here (the zoo's builder), never in autotp's logic.
"""

from __future__ import annotations

import importlib.util
import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from autotp.capture.examples import EXAMPLE_BATCH, EXAMPLE_SEQ, synthesise
from autotp.tools.tiny import MAX_PARAMS, default_config, quiet, tiny_model
from autotp.tools.zoo_stubs import refresh_transformers_checks, torchvision_stub


@dataclass(frozen=True)
class Entry:
    """One model of the zoo: how to build it and what to feed it (a tuple of positional tensors or a dict
    of keyword ones)."""

    name: str
    family: str
    build: Callable[[], nn.Module]
    inputs: Callable[[nn.Module], tuple | dict]


@dataclass(frozen=True)
class Group:
    """A task: the transformers mapping that lists its model types, and how its models are built and fed."""

    family: str
    mapping: str
    inputs: Callable[[nn.Module], tuple | dict]
    suffix: str = ""
    """Appended to the type in the entry's name (causal LMs keep the bare type)."""
    new_trunks_only: bool = False
    """List only types whose trunk no earlier group checks (a classification head on a checked trunk adds a
    2-wide matrix, never split, and no structure)."""


def token_ids(model: nn.Module) -> tuple:
    """The token ids ``autotp.plan`` synthesises when given none."""
    return synthesise(model).flat


def document_inputs(model: nn.Module) -> tuple | dict:
    """Token ids, with a box per token (corners ``x0, y0, x1, y1`` on the 0-1000 page scale) for a document model
    whose forward takes ``bbox`` (some refuse to run without one)."""
    (ids,) = token_ids(model)
    if "bbox" not in inspect.signature(model.forward).parameters:
        return (ids,)
    corners = torch.randint(0, 500, (*ids.shape, 2), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "bbox": torch.cat([corners, corners + 100], dim=-1)}


def seq2seq_inputs(model: nn.Module) -> dict:
    """Token ids, their mask, and decoder ids half as long (token ids alone for a decoder-only model the
    mapping lists, such as a speech LM fed text)."""
    (ids,) = token_ids(model)
    if not getattr(model.config, "is_encoder_decoder", False):
        return {"input_ids": ids} | streamed_audio(model, ids)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "decoder_input_ids": ids[:, : EXAMPLE_SEQ // 2]}


def _seeded(*shape) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(0))


def _vision(config):
    """The config that holds the image geometry (the vision sub-config of a two-tower model)."""
    return getattr(config, "vision_config", None) or getattr(config, "backbone_config", None) or config


def pixel_values(model: nn.Module) -> dict | tuple:
    """Random images of the config's size (square, or height and width) and channels; token ids for a model
    whose main input is token ids (an image GPT, a vision-language classifier)."""
    if getattr(model, "main_input_name", "") == "input_ids":
        return token_ids(model)
    return pixel_values_of(model)


def pixel_values_of(model: nn.Module) -> dict:
    """Random images of the config's size (square, or height and width) and channels, under ``pixel_values``."""
    config = _vision(model.config)
    if "spatial_shapes" in inspect.signature(model.forward).parameters:
        return patch_sequences(config)
    size = getattr(config, "image_size", 32)
    height, width = (size[0], size[-1]) if isinstance(size, (list, tuple)) else (size, size)
    return {"pixel_values": _seeded(EXAMPLE_BATCH, getattr(config, "num_channels", 3), height, width)}


def patch_sequences(config) -> dict:
    """Images already cut into patches, as a NaViT-style tower (SigLIP 2) takes them: (batch, patches, channels x
    patch x patch) for a square grid of the config's ``num_patches``, every patch real, and the grid's shape."""
    side = math.isqrt(getattr(config, "num_patches", 16))
    width = getattr(config, "num_channels", 3) * config.patch_size ** 2
    return {"pixel_values": _seeded(EXAMPLE_BATCH, side * side, width),
            "pixel_attention_mask": torch.ones(EXAMPLE_BATCH, side * side, dtype=torch.long),
            "spatial_shapes": torch.tensor([[side, side]] * EXAMPLE_BATCH)}


_FEATURE_FIELDS = ("input_feat_per_channel", "feature_projection_input_dim", "feature_size")
"""Fields that size each frame of audio features, most specific first (a front end's input width before the
raw extractor's ``feature_size``)."""


def _audio(config):
    """The config that sizes the audio features: the config itself where it has a feature field, else its audio
    or encoder sub-config (a CTC head over a wrapped encoder)."""
    fields = ("num_mel_bins", *_FEATURE_FIELDS)
    if any(getattr(config, f, None) for f in fields):
        return config
    subs = (getattr(config, name, None) for name in ("audio_config", "encoder_config", "encoder"))
    return next((sub for sub in subs if any(getattr(sub, f, None) for f in fields)), config)


def vision_text_inputs(model: nn.Module) -> tuple | dict:
    """Token ids alone (the vision tower built but not reached), or by keyword with images where the forward
    requires them (a captioner whose first parameter is ``pixel_values``)."""
    (ids,) = token_ids(model)
    parameters = inspect.signature(model.forward).parameters
    needs_images = "pixel_values" in parameters and parameters["pixel_values"].default is inspect.Parameter.empty
    if not needs_images and next(iter(parameters), None) == "input_ids":
        return (ids,)
    queries, image_token = (getattr(model.config, f, None) for f in ("num_query_tokens", "image_token_id"))
    if needs_images and isinstance(queries, int) and isinstance(image_token, int):
        # a Q-Former's queries take the places of that many image tokens in the text, and of no others
        ids = torch.where(ids == image_token, 0, ids)
        ids[:, :queries] = image_token
    return {"input_ids": ids} | (pixel_values_of(model) if needs_images else {})


def _features(model: nn.Module, frames: int = 64) -> torch.Tensor:
    """Random audio features as the config sizes them: (batch, mel bins, twice the source positions) for a
    Whisper-style encoder, else (batch, frames, features)."""
    config = _audio(model.config)
    mel = getattr(config, "num_mel_bins", None)
    if mel is not None and getattr(config, "max_source_positions", None):
        return _seeded(EXAMPLE_BATCH, mel, 2 * config.max_source_positions)
    features = mel or next((getattr(config, f) for f in _FEATURE_FIELDS if getattr(config, f, None)), 80)
    return _seeded(EXAMPLE_BATCH, frames, features * getattr(config, "input_channels", 1))


def audio_inputs(model: nn.Module) -> dict:
    """Audio under the model's main input: a quarter second of 16 kHz samples (a dozen frames after a
    wav2vec2-style front end), or features."""
    name = getattr(model, "main_input_name", "input_values")
    # a wrapper's generic input (``inputs``) is its encoder's main input: raw samples or features as that says
    kind = getattr(getattr(model, "encoder", None), "main_input_name", name) if name == "inputs" else name
    return {name: _seeded(EXAMPLE_BATCH, 4000) if kind == "input_values" else _features(model)}


def speech_seq2seq_inputs(model: nn.Module) -> dict:
    """Audio under the model's main input, and decoder ids; a speech LM whose main input is token ids is fed
    text only."""
    name = getattr(model, "main_input_name", "input_features")
    (ids,) = synthesise(model).flat
    if name == "input_ids":
        codebooks, codes_vocab = (getattr(model.config, f, None) for f in ("num_codebooks", "codebook_vocab_size"))
        if isinstance(codebooks, int) and isinstance(codes_vocab, int) and not model.config.is_encoder_decoder:
            # a speech LM over a text stream and audio codebooks: each step a text token and a code per codebook
            codes = torch.randint(0, codes_vocab - 1, (*ids.shape, codebooks),
                                  generator=torch.Generator().manual_seed(0))
            return {"input_ids": torch.cat([ids[..., None], codes], dim=-1)}
        return {"input_ids": ids} | ({"decoder_input_ids": _decoder_ids(model, ids)} if model.config.is_encoder_decoder
                                     else streamed_audio(model, ids))
    return audio_inputs(model) | {"decoder_input_ids": _decoder_ids(model, ids)}


def streamed_audio(model: nn.Module, ids: torch.Tensor) -> dict:
    """Audio features beside the text for a streaming speech LM, which adds its audio to the text a token at a
    time (its config's ``audio_length_per_tok`` frames per token); {} for any other model."""
    per_token = getattr(model.config, "audio_length_per_tok", None)
    if not isinstance(per_token, int):
        return {}
    mel = getattr(_audio(model.config), "num_mel_bins", None) or 80
    return {"input_features": _seeded(ids.shape[0], mel, ids.shape[1] * per_token)}


def _decoder_ids(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Decoder ids, 8 steps: token ids, or where the decoder reads several audio channels a step (its config's
    ``num_channels`` codebooks, each of its ``vocab_size``), a code per channel per step."""
    decoder = getattr(model.config, "decoder_config", None)
    channels, vocab = getattr(decoder, "num_channels", None), getattr(decoder, "vocab_size", None)
    if isinstance(channels, int) and isinstance(vocab, int):
        return torch.randint(0, vocab, (ids.shape[0], 8, channels), generator=torch.Generator().manual_seed(0))
    return ids[:, :8]


GROUPS = (
    Group("causal-lm", "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", token_ids),
    Group("masked-lm", "MODEL_FOR_MASKED_LM_MAPPING_NAMES", document_inputs, ":mlm"),
    Group("seq2seq-lm", "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES", seq2seq_inputs,
          ":seq2seq"),
    Group("sequence-classification", "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES", document_inputs, ":cls",
          new_trunks_only=True),
    Group("token-classification", "MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES",
          document_inputs, ":tokens", new_trunks_only=True),
    Group("image-classification", "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES",
          pixel_values, ":image"),
    Group("backbone", "MODEL_FOR_BACKBONE_MAPPING_NAMES", pixel_values, ":backbone"),
    Group("speech-seq2seq", "MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES",
          speech_seq2seq_inputs, ":speech"),
    Group("ctc", "MODEL_FOR_CTC_MAPPING_NAMES", audio_inputs, ":ctc"),
    Group("image-text-to-text", "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES",
          vision_text_inputs, ":vlm"),
)
"""The task groups, in the order of the coverage table. Vision-language models are fed text only where their
forward allows it: their vision tower is built but not reached, and not counted in the split fraction."""


def _hf_build(model_type: str, class_names: str | tuple[str, ...]) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        import transformers

        # the mapping's own class (the first where it lists several): an auto class picks among several by
        # the config's architectures, which a fresh config does not name
        cls = getattr(transformers, class_names if isinstance(class_names, str) else class_names[0])

        def on_meta(config):
            config = config_of(cls, config)
            with torch.device("meta"):
                cls(config)
            return config

        with quiet():
            try:  # on the meta device: no memory, and errors read as they come
                config = tiny_model(model_type, on_meta)
            except Exception as e:  # whose fault: the tiny config's, or the model's own default config's too
                own = _default_failure(model_type, cls)
                if own is None:
                    raise
                raise ValueError(f"the model does not build from its own default config either: {own}") from e
            with torch.device("meta"):
                counts = _counts_by_part(cls(config))
            count = sum(counts.values())
            if count > MAX_PARAMS:
                part, most = max(counts.items(), key=lambda kv: kv[1])
                raise ValueError(f"the tiny config still has {count / 1e6:.0f}M parameters in parts whose sizes no "
                                 f"config field sets ({most / 1e6:.0f}M in {part}); not built")
            torch.manual_seed(0)
            return cls(config)

    return build


def config_of(cls, config):
    """The config ``cls`` is built from: ``config`` itself, or the sub-config of the class's own ``config_class``
    where the mapping names a composite type for a class that takes one part (Llama 4's causal LM takes the text
    config of the multimodal ``Llama4Config``, MusicGen's its ``decoder``)."""
    want = getattr(cls, "config_class", None)
    if not isinstance(want, type) or isinstance(config, want):
        return config
    subs = (getattr(config, name, None) for name in getattr(type(config), "sub_configs", {}))
    return next((sub for sub in subs if isinstance(sub, want)), config)


def _counts_by_part(model: nn.Module, depth: int = 3) -> dict[str, int]:
    """Parameter counts of ``model`` by the first ``depth`` parts of their names (which tower holds the size)."""
    out: dict[str, int] = {}
    for name, p in model.named_parameters():
        part = ".".join(name.split(".")[:depth])
        out[part] = out.get(part, 0) + p.numel()
    return out


def _default_failure(model_type: str, cls) -> str | None:
    """Why ``cls`` does not build (on the meta device) from the default config of ``model_type``, in one line; None
    if it builds."""
    try:
        config = config_of(cls, default_config(model_type))
        with torch.device("meta"):
            cls(config)
    except Exception as e:  # any type: the message is the reason
        return f"{type(e).__name__}: {' '.join(str(e).split())[:200]}"
    return None


def hf_entries() -> list[Entry]:
    """One entry per (task group, model type) of the installed transformers."""
    torchvision_stub()  # transformers' timm-backed vision towers import timm, which imports torchvision
    refresh_transformers_checks()
    from transformers.models.auto import modeling_auto

    out, seen = [], set()
    for group in GROUPS:
        mapping = getattr(modeling_auto, group.mapping, {})
        types = [t for t in mapping if not (group.new_trunks_only and t in seen)]
        out += [Entry(t + group.suffix, group.family, _hf_build(t, mapping[t]), group.inputs) for t in types]
        if group.family in ("causal-lm", "masked-lm", "seq2seq-lm"):
            seen |= set(types)
    return out


def torch_entries() -> list[Entry]:
    """torch's own encoder stack and encoder-decoder (the latter fed a causal mask, as its users pass one)."""
    def encoder():
        layer = nn.TransformerEncoderLayer(64, 4, 128, dropout=0.1, batch_first=True)
        return nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)

    def transformer():
        return nn.Transformer(64, 4, 2, 2, 128, dropout=0.1, batch_first=True)

    def hidden(_model):
        return (_seeded(EXAMPLE_BATCH, EXAMPLE_SEQ, 64),)

    def pair(_model):
        tgt = EXAMPLE_SEQ // 2
        return {"src": _seeded(EXAMPLE_BATCH, EXAMPLE_SEQ, 64), "tgt": _seeded(EXAMPLE_BATCH, tgt, 64),
                "tgt_mask": nn.Transformer.generate_square_subsequent_mask(tgt)}

    return [Entry("nn.TransformerEncoder", "torch", encoder, hidden), Entry("nn.Transformer", "torch", transformer, pair)]


TIMM_VITS = ("vit_base_patch16_224", "deit_base_distilled_patch16_224", "vit_base_patch16_clip_224",
             "vit_base_patch16_siglip_224", "vit_base_patch16_reg4_gap_256", "eva02_base_patch14_224",
             "vit_relpos_base_patch16_224", "beit_base_patch16_224")
"""timm's ViT family: plain, distilled, CLIP and SigLIP towers, registers, EVA-02 (rotary, SwiGLU),
relative positions, BEiT."""


def timm_entries() -> list[Entry]:
    """timm's ViT family at a tiny size, when timm is installed."""
    if importlib.util.find_spec("timm") is None:
        return []

    def build(name: str) -> nn.Module:
        torchvision_stub()
        import timm

        return timm.create_model(name, pretrained=False, img_size=32, patch_size=8, depth=2, embed_dim=64,
                                 num_heads=4, num_classes=16)

    def images(_model):
        return (_seeded(EXAMPLE_BATCH, 3, 32, 32),)

    return [Entry(f"timm:{n}", "timm", lambda n=n: build(n), images) for n in TIMM_VITS]


def example_entries(extra: tuple[str, ...] = ()) -> list[Entry]:
    """The repository's examples, and any ``file.py:factory`` given."""
    from autotp.tools.model_spec import build_model, parse_spec

    return [Entry(spec, "example", lambda spec=spec: build_model(parse_spec(spec)), token_ids)
            for spec in ("examples/gpt.py:build_gpt", "examples/llama.py:build_llama", *extra)]
