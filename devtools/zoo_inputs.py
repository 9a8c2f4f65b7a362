"""What the zoo feeds each model: token ids, boxes, images, audio, decoder ids, as the model's config sizes them and
its forward's signature asks for (``zoo_entries``' task groups name one of these per group)."""

from __future__ import annotations

import inspect
import math
import re

import torch
from torch import nn

from autotp.capture import model_kwargs
from autotp.capture.core.examples import EXAMPLE_BATCH, EXAMPLE_SEQ, example_inputs_of, synthesise


def token_ids(model: nn.Module) -> tuple:
    """The token ids ``autotp.plan`` synthesises when given none."""
    return synthesise(model).flat


def document_inputs(model: nn.Module) -> tuple | dict:
    """Token ids, with a box per token (corners ``x0, y0, x1, y1`` on the 0-1000 page scale) for a document model
    whose forward takes ``bbox`` (some refuse to run without one)."""
    (ids,) = token_ids(model)
    if "bbox" not in inspect.signature(model.forward).parameters:
        return (ids,)
    return {"input_ids": ids, "bbox": _boxes(ids)}


def _boxes(ids: torch.Tensor) -> torch.Tensor:
    """A box per token, corners ``x0, y0, x1, y1`` on the 0-1000 page scale."""
    corners = torch.randint(0, 500, (*ids.shape, 2), generator=torch.Generator().manual_seed(0))
    return torch.cat([corners, corners + 100], dim=-1)


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


def flattened_patches(config, side: int = 4) -> dict:
    """Images as Pix2Struct's processor gives them: (batch, patches, 2 + channels x patch x patch), each patch's
    row and column (from 1) before its pixels, a square grid of ``side`` x ``side`` patches, and their mask."""
    grid = torch.arange(1, side + 1, dtype=torch.float32)
    rows, cols = grid.repeat_interleave(side), grid.repeat(side)
    width = _vision(config).patch_embed_hidden_size
    pixels = _seeded(EXAMPLE_BATCH, side * side, width)
    places = torch.stack([rows, cols], dim=-1).expand(EXAMPLE_BATCH, -1, -1)
    return {"flattened_patches": torch.cat([places, pixels], dim=-1),
            "attention_mask": torch.ones(EXAMPLE_BATCH, side * side, dtype=torch.long)}


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
    """Token ids alone where the forward runs on them (the vision tower built but not reached); else, by keyword,
    what the forward's signature asks for: images where it requires them, its main input is images, or it refuses
    text alone; every other required ``*input_ids`` (a Q-Former's) as the token ids; decoder ids for an
    encoder-decoder; a box per token where it takes ``bbox``; each token's type (``token_type_ids``,
    ``mm_token_type_ids``: all text) where the forward takes it; the places of an image's latent queries where it
    takes them."""
    (ids,) = token_ids(model)
    parameters = inspect.signature(model.forward).parameters
    required = {k for k, p in parameters.items()
                if p.default is inspect.Parameter.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    takes_images = "pixel_values" in parameters
    needs_images = takes_images and ("pixel_values" in required or getattr(model, "main_input_name", "") == "pixel_values")
    takes_types = any(k.endswith("token_type_ids") for k in parameters)
    if not needs_images and not takes_types and next(iter(parameters), None) == "input_ids" \
            and not required - {"input_ids"} and _runs(model, (ids,)):
        return (ids,)
    queries, image_token = (getattr(model.config, f, None) for f in ("num_query_tokens", "image_token_id"))
    if takes_images and isinstance(queries, int) and isinstance(image_token, int):
        # a Q-Former's queries take the places of that many image tokens in the text, and of no others
        ids = _image_tokens_at(ids, image_token, 0, queries)
    text = {k: ids for k in parameters if k == "input_ids" or (k in required and k.endswith("input_ids"))}
    if getattr(model, "main_input_name", "") == "flattened_patches":
        text |= flattened_patches(model.config)
    if getattr(model.config, "is_encoder_decoder", False) and "decoder_input_ids" in parameters:
        text["decoder_input_ids"] = ids[:, : EXAMPLE_SEQ // 2]
    latents = getattr(model.config, "latent_query_num", None)
    if "image_embeds_position_mask" in parameters and isinstance(latents, int):
        # the image's latent queries take the places the mask marks, after the first token (Kosmos-2's layout)
        text["image_embeds_position_mask"] = torch.zeros_like(ids)
        text["image_embeds_position_mask"][:, 1:1 + latents] = 1
    if "bbox" in parameters:
        text["bbox"] = _boxes(ids)
    if getattr(model, "main_input_name", "") == "state":
        text |= {k: v for k, v in policy_inputs(model.config).items() if k in parameters}
    types = {k: torch.zeros_like(ids) for k in parameters if k.endswith("token_type_ids") and k not in text}
    if types and _runs(model, text | types):
        # each token's type (all text, or all prefix), as such a model is trained with: some require it in
        # training, and without it PaliGemma's forward skips an all-ones mask when run and builds it when traced
        text |= types
    if not needs_images and takes_images and not _runs(model, text):
        needs_images = True  # it refuses text alone (an image-conditioned decoder)
    if not needs_images:
        return text
    images = pixel_values_of(model)
    if "spatial_shapes" not in images and not _runs(model, text | images):
        # images grouped per sample (several images, or a video's frames): one each, every token seeing it
        grouped = {"pixel_values": images["pixel_values"][:, None]}
        if "image_attention_mask" in parameters:
            grouped["image_attention_mask"] = torch.ones(*ids.shape, 1, dtype=torch.long)
        if "pixel_attention_mask" in parameters:  # which of a sample's images (cameras) are there
            grouped["pixel_attention_mask"] = torch.ones(ids.shape[0], 1, dtype=torch.bool)
        images = grouped if _runs(model, text | grouped) else images
    if "input_ids" in text and not _runs(model, text | images):
        text = _with_image_tokens(model, text, images) or text
    return text | images


def _with_image_tokens(model: nn.Module, text: dict, images: dict) -> dict | None:
    """``text`` with its image tokens where the images' features go: as many per sample, after the first token,
    as the model's ``get_image_features`` gives per image (a forward that checks the two counts agree refuses
    random ids); None where the model names no image token or has no such method."""
    token = next((v for v in (getattr(model.config, f, None) for f in ("image_token_id", "image_token_index"))
                  if isinstance(v, int)), None)
    get = getattr(model, "get_image_features", None) or getattr(getattr(model, "model", None), "get_image_features",
                                                                None)
    if token is None or get is None:
        return None
    try:
        with torch.no_grad():
            features = get(**images)
    except Exception:  # the method wants other arguments: leave the ids as they are
        return None
    pooled = getattr(features, "pooler_output", features)  # None for a tower whose last state is its features
    features = getattr(features, "last_hidden_state", None) if pooled is None else pooled
    parts = features if isinstance(features, (list, tuple)) else [features]
    count = sum(p.shape[:-1].numel() for p in parts if isinstance(p, torch.Tensor))
    ids = text["input_ids"]
    per_sample, rest = divmod(count, ids.shape[0])
    if rest or not 0 < per_sample < ids.shape[1]:
        return None
    return text | {"input_ids": _image_tokens_at(ids, token, 1, per_sample)}


def _image_tokens_at(ids: torch.Tensor, token: int, start: int, count: int) -> torch.Tensor:
    """``ids`` with ``count`` image tokens from position ``start`` in every sample, and none elsewhere."""
    ids = torch.where(ids == token, 0, ids)
    ids[:, start:start + count] = token
    return ids


def policy_inputs(config) -> dict:
    """A flow-matching action policy's inputs beside its prompt (PI0): the robot's state, the noise its actions
    are denoised from and the denoising time, given rather than drawn inside the forward (as the config sizes
    them)."""
    return {"state": _seeded(EXAMPLE_BATCH, config.max_state_dim),
            "noise": _seeded(EXAMPLE_BATCH, config.chunk_size, config.max_action_dim),
            "timestep": torch.full((EXAMPLE_BATCH,), 0.5)}


def _runs(model: nn.Module, inputs: tuple | dict) -> bool:
    """Whether ``model``'s forward runs on ``inputs`` (positional or by keyword), without gradients, called as
    autotp calls it (no KV cache)."""
    try:
        with torch.no_grad():
            example_inputs_of(model, inputs).call(model, model_kwargs(model))
    except Exception:  # any failure: the caller tries what else the forward may need
        return False
    return True


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
    if kind == "input_values":
        return {name: _read_channels(model, name, _seeded(EXAMPLE_BATCH, 4000))}
    return {name: _read_width(model, name, _features(model))}


def _refusal(model: nn.Module, name: str, value: torch.Tensor) -> str:
    """What the model's forward on ``value`` alone (under ``name``) raises, in words; "" where it runs, or where
    it is an encoder-decoder (fed with decoder ids too: a forward on audio alone is no probe, it may change state).
    The probes below read the sizes a model wants from the refusal of the ones it was given."""
    if getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        return ""
    try:
        with torch.no_grad(), torch.random.fork_rng():
            model(**{name: value})
    except Exception as e:  # any type: only its words are read, and words of another failure match nothing
        return str(e)
    return ""


_CHANNELS = re.compile(r"expected input\[1, (\d+), (\d+)\] to have (\d+) channels")


def _read_channels(model: nn.Module, name: str, samples: torch.Tensor) -> torch.Tensor:
    """``samples`` (batch, samples), or (batch, channels, samples) where the model's first convolution takes the
    samples with a channel axis (OmniASR's): it then reads the 2-D batch as one unbatched example, and its
    refusal states the channels it takes."""
    found = _CHANNELS.search(_refusal(model, name, samples))
    if found and (int(found[1]), int(found[2])) == tuple(samples.shape):
        return _seeded(samples.shape[0], int(found[3]), samples.shape[1])
    return samples


_MATMUL = re.compile(r"mat1 and mat2 shapes cannot be multiplied \((\d+)x(\d+) and (\d+)x(\d+)\)")


def _read_width(model: nn.Module, name: str, features: torch.Tensor) -> torch.Tensor:
    """``features``, or features as wide as the model's first projection reads them where that differs: a front end
    may stack frames or deltas before it (Granite Speech 5's reads four mel bins' worth per frame), which no config
    field names, and the projection's refusal states the width it takes."""
    found = _MATMUL.search(_refusal(model, name, features))
    if found and int(found[2]) == features.shape[-1] and int(found[3]) != features.shape[-1]:
        return _seeded(*features.shape[:-1], int(found[3]))
    return features


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
