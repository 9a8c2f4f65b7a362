"""The zoo's population: every model class of transformers' task mappings people train or run, grouped by
task, diffusers' transformers and timm's ViT family when those are installed, torch's own, and the examples.

Each group names the transformers mapping it reads (whose classes build its models) and the inputs it is fed.
Type names appear only in the tables here (the zoo's builder), never in autotp's logic.
"""

from __future__ import annotations

import importlib.util
import os
import re
import traceback
from collections.abc import Callable
from copy import deepcopy
from dataclasses import dataclass

import torch
from torch import nn

from autotp.capture.core.examples import EXAMPLE_BATCH, EXAMPLE_SEQ
from devtools.tiny import MAX_PARAMS, default_config, quiet, tiny_model
from devtools.zoo_inputs import (
    _seeded,
    audio_inputs,
    document_inputs,
    pixel_values,
    seq2seq_inputs,
    speech_seq2seq_inputs,
    token_ids,
    vision_text_inputs,
)
from devtools.zoo_stubs import refresh_transformers_checks, torchvision_stub


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


POSITION_FIELDS = ("max_position_embeddings", "n_positions", "n_ctx", "max_target_positions", "max_seq_len")
"""Config fields that size a model's position tables and causal-mask buffers (the longest sequence it takes)."""

POSITION_OFFSETS = 3
"""Positions a table may keep before the first token's: RoBERTa's start after its padding index (2 for a padding
id of 1), so its table must be 2 longer than the longest sequence."""


def full_context(model_type: str, offset: int = 0) -> dict:
    """Overrides that make ``model_type``'s position tables and mask buffers as long as the zoo's example sequence
    (``EXAMPLE_SEQ``) plus ``offset``: the example then reads them whole (``mask[:T, :T]``, ``pos[:T]`` at T equal
    to the table's length), the usual training shape."""
    fields = default_config(model_type).to_dict()
    return {name: EXAMPLE_SEQ + offset for name in POSITION_FIELDS if isinstance(fields.get(name), int)}


def _tiny_at_full_context(model_type: str, made: Callable) -> nn.Module:
    """``tiny_model`` with the shortest position tables (``full_context``, offsets from 0) the model runs its
    example on: the first offset that builds and runs."""
    error = None
    for offset in range(POSITION_OFFSETS):
        try:
            return tiny_model(model_type, made, full_context(model_type, offset))
        except _TooLarge:
            raise
        except Exception as e:  # the model's own error at a table too short for the example; the first is reported
            error = error or e
    raise error


def _hf_build(model_type: str, class_names: str | tuple[str, ...],
              inputs: Callable[[nn.Module], tuple | dict] | None = None,
              at_full_context: bool = False) -> Callable[[], nn.Module]:
    """The build of ``model_type``'s tiny model (the mapping's class), which must run on ``inputs`` (if given): a
    tiny config the model builds from but does not run on (one of ``tiny_model``'s variants) is not the one. With
    ``at_full_context``, its position tables are as long as the example (``full_context``)."""
    def build() -> nn.Module:
        import transformers

        # the mapping's own class (the first where it lists several): an auto class picks among several by
        # the config's architectures, which a fresh config does not name
        cls = getattr(transformers, class_names if isinstance(class_names, str) else class_names[0])

        def made(config):
            config = config_of(cls, config)
            with torch.device("meta"):  # on the meta device first: no memory, and errors read as they come
                counts = _counts_by_part(cls(config))
            _check_size(counts)
            torch.manual_seed(0)
            model = cls(config)
            if inputs is not None:
                _runs(model, inputs)
            return model

        with quiet():
            try:
                if at_full_context:
                    return _tiny_at_full_context(model_type, made)
                return tiny_model(model_type, made)
            except _TooLarge:
                raise
            except Exception as e:  # whose fault: the tiny config's, or the model's own default config's too
                own = _default_failure(model_type, cls)
                if own is None:
                    raise
                raise ValueError(f"the model does not build from its own default config either: {own}") from e

    return build


class _TooLarge(ValueError):
    """A tiny config whose model still has more than ``MAX_PARAMS`` parameters."""


def _check_size(counts: dict[str, int]) -> None:
    count = sum(counts.values())
    if count > MAX_PARAMS:
        part, most = max(counts.items(), key=lambda kv: kv[1])
        raise _TooLarge(f"the tiny config still has {count / 1e6:.0f}M parameters in parts whose sizes no "
                        f"config field sets ({most / 1e6:.0f}M in {part}); not built")


def _runs(model: nn.Module, inputs: Callable[[nn.Module], tuple | dict]) -> None:
    """Run a copy of ``model`` on its inputs as the zoo will (raising the model's error if it fails), leaving the
    model and the random state as they were."""
    from autotp.capture import model_kwargs
    from autotp.capture.core.examples import example_inputs_of

    with torch.random.fork_rng(), torch.no_grad():
        copy = deepcopy(model)
        example_inputs_of(copy, inputs(copy)).call(copy, model_kwargs(copy))


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


def hf_entries(at_full_context: bool = False) -> list[Entry]:
    """One entry per (task group, model type) of the installed transformers (built ``at_full_context``: position
    tables as long as the example's sequence)."""
    torchvision_stub()  # transformers' timm-backed vision towers import timm, which imports torchvision
    refresh_transformers_checks()
    from transformers.models.auto import modeling_auto

    out, seen = [], set()
    for group in GROUPS:
        mapping = getattr(modeling_auto, group.mapping, {})
        types = [t for t in mapping if not (group.new_trunks_only and t in seen)]
        out += [Entry(t + group.suffix, group.family, _hf_build(t, mapping[t], group.inputs, at_full_context),
                      group.inputs) for t in types]
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

        # 96 wide: the MLP widths divide by 4 (EVA-02's SwiGLU is 8/3 wide, 170 of 64, 256 of 96, as 2048 of 768)
        return timm.create_model(name, pretrained=False, img_size=32, patch_size=8, depth=2, embed_dim=96,
                                 num_heads=4, num_classes=16)

    def images(_model):
        return (_seeded(EXAMPLE_BATCH, 3, 32, 32),)

    return [Entry(f"timm:{n}", "timm", lambda n=n: build(n), images) for n in TIMM_VITS]


def example_entries(extra: tuple[str, ...] = ()) -> list[Entry]:
    """The repository's examples, and any ``file.py:factory`` given."""
    from autotp.tools.model_spec import build_model, parse_spec

    return [Entry(spec, "example", lambda spec=spec: build_model(parse_spec(spec)), token_ids)
            for spec in ("examples/gpt.py:build_gpt", "examples/llama.py:build_llama", *extra)]


_MISSING_LIBRARY = re.compile(r"requires the (\S+) library but it was not found|The '([^']+)' distribution was not found")
"""transformers' message for a library a model needs, and importlib's for a distribution a package asks for by name
(diffusers asks for ``requests`` when it is installed without its dependencies)."""


def build_reason(e: BaseException) -> str:
    """Why an entry does not build, in one line: an optional library the model needs and that is not installed
    (transformers' message, or a module not found) is named alone; else the error's own line."""
    found = _MISSING_LIBRARY.search(str(e)) if isinstance(e, ImportError) else None
    library = (found[1] or found[2]) if found else getattr(e, "name", None) if isinstance(e, ModuleNotFoundError) \
        else None
    if library:
        return f"needs the {library} library, not installed"
    where = _raised_in_model_code(e)
    return error_line(e) + (f" (raised by the model's own code, {where})" if where else "")


def _raised_in_model_code(e: BaseException) -> str | None:
    """``file:line`` of the deepest frame of the traceback in a model's own source (a file of a ``models``
    package, as transformers' ``models/<type>/modeling_<type>.py``): where the model itself gave up, whatever the
    zoo's builder did before."""
    frames = traceback.extract_tb(e.__traceback__)
    own = [f for f in frames if f"{os.sep}models{os.sep}" in f.filename and "autotp" not in f.filename]
    return f"{os.path.basename(own[-1].filename)}:{own[-1].lineno}" if own else None


def error_line(e: BaseException) -> str:
    """An error in one line: its type and its message, spaces collapsed, cut at 300 characters."""
    text = " ".join(str(e).split()) or type(e).__name__
    return f"{type(e).__name__}: {text[:300]}"
