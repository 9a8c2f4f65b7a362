"""Turn a MODEL spec from the command line into an ``nn.Module`` and example token ids.

A spec names where the model comes from:

- ``path/to/file.py:factory`` or ``path/to/file.py:Class``: a file, and a callable in it;
- ``package.module:factory``: an importable module (the current directory is importable, as with ``python -m``);
- ``hf:<model_type>``: a Hugging Face architecture from transformers' registry, shrunk to a small config;
- ``hf:path/to/config.json`` (or a folder holding one): a Hugging Face config as written, full size.

``--set key=value`` overrides become keyword arguments of the factory, or config fields for ``hf:``.
Hugging Face models are built on the meta device: planning needs shapes, not weights, so a full-size
config costs no memory.
"""

from __future__ import annotations

import ast
import contextlib
import difflib
import importlib
import importlib.util
import json
import re
import sys
import traceback
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

import torch
from torch import nn

# The example sizes and the vocabulary guess live with capture (autotp.plan synthesises the same ids);
# they are imported here too because the zoo reads them from this module.
from autotp.capture.core.examples import synthesise
from autotp.errors import InputError

SPEC_FORMS = "path/to/file.py:factory, package.module:factory, hf:<model_type> or hf:path/to/config.json"

SMALL_HF = {
    "vocab_size": 128, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "n_embd": 64, "n_layer": 2, "n_head": 4, "rotary_dim": 16,
    # the same sizes under the other names configs use (encoder-decoders, T5, XLNet-style)
    "d_model": 64, "encoder_layers": 2, "decoder_layers": 2, "encoder_attention_heads": 4,
    "decoder_attention_heads": 4, "encoder_ffn_dim": 128, "decoder_ffn_dim": 128, "ffn_dim": 128,
    "num_layers": 2, "num_decoder_layers": 2, "num_heads": 4, "d_ff": 128, "d_kv": 16, "n_heads": 4,
}
"""The small config ``hf:<model_type>`` starts from (fields the architecture has), before ``--set``.
Four heads and two KV heads keep tp in {1, 2, 4} valid; head_dim is hidden_size / heads."""

"""Shape of the token ids the model is captured with; capture keeps batch and sequence dynamic, so
the plan holds at any size and costs are evaluated at ``--batch``/``--seq`` instead."""


class SpecKind(str, Enum):
    """Where a MODEL spec takes the model from."""

    FILE = "file"
    """A Python file and a callable (or module instance) in it."""
    MODULE = "module"
    """An importable module and a callable (or module instance) in it."""
    HF_TYPE = "hf_type"
    """A transformers model type, built from a small config."""
    HF_CONFIG = "hf_config"
    """A transformers config.json (or a folder holding one), built as written."""


@dataclass(frozen=True)
class ModelSpec:
    """A parsed MODEL spec."""

    kind: SpecKind
    target: str
    """The file path, module name, model type or config path."""
    attr: str = ""
    """The factory, class or instance inside the file or module (dotted for nested attributes)."""
    overrides: tuple[tuple[str, object], ...] = ()
    """``--set`` values, in order: factory keyword arguments or config fields."""

    def __str__(self) -> str:
        prefix = "hf:" if self.kind in (SpecKind.HF_TYPE, SpecKind.HF_CONFIG) else ""
        return f"{prefix}{self.target}" + (f":{self.attr}" if self.attr else "")


def parse_value(text: str) -> object:
    """A ``--set`` value: JSON (``4``, ``true``, ``null``, ``[1, 2]``), a Python literal, else the string."""
    for parse in (json.loads, ast.literal_eval):
        try:
            return parse(text)
        except (ValueError, SyntaxError):
            continue
    return text


def parse_overrides(items: list[str] | tuple[str, ...]) -> tuple[tuple[str, object], ...]:
    """``["num_hidden_layers=4", ...]`` -> ``(("num_hidden_layers", 4), ...)``."""
    out = []
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip().isidentifier():
            raise InputError(f"--set takes name=value (like --set num_hidden_layers=4), got {item!r}")
        out.append((key.strip(), parse_value(value.strip())))
    return tuple(out)


def parse_spec(text: str, overrides: tuple[tuple[str, object], ...] = ()) -> ModelSpec:
    """Parse a MODEL spec; ``InputError`` names the accepted forms when it fits none."""
    if text.startswith("hf:"):
        rest = text[3:]
        if rest.endswith(".json") or "/" in rest or Path(rest).is_dir():
            return ModelSpec(SpecKind.HF_CONFIG, rest, "", overrides)
        if re.fullmatch(r"[A-Za-z0-9_\-]+", rest):
            return ModelSpec(SpecKind.HF_TYPE, rest, "", overrides)
        raise InputError(f"MODEL {text!r}: after 'hf:' give a model type (hf:llama) or a config path (hf:config.json)")
    target, sep, attr = text.rpartition(":")
    if not sep or not target or not all(part.isidentifier() for part in attr.split(".")):
        raise InputError(f"MODEL {text!r} is not a model spec; use {SPEC_FORMS}")
    if target.endswith(".py") or "/" in target or "\\" in target:
        return ModelSpec(SpecKind.FILE, target, attr, overrides)
    if all(part.isidentifier() for part in target.split(".")):
        return ModelSpec(SpecKind.MODULE, target, attr, overrides)
    raise InputError(f"MODEL {text!r}: {target!r} is neither a .py file nor a dotted module name; use {SPEC_FORMS}")


_FILE_MODULE_PREFIX = "_autotp_model_"
"""Module names model files are imported under (removed from ``sys.modules`` once the model is built)."""


@contextlib.contextmanager
def _importable(*folders: str):
    """Make ``folders`` importable while a model is built, then put ``sys.path`` and the model files'
    ``sys.modules`` entries back as they were (building a model leaves no trace on the process)."""
    path, before = list(sys.path), set(sys.modules)
    sys.path[:0] = [f for f in folders if f not in sys.path]
    try:
        yield
    finally:
        sys.path[:] = path
        for name in set(sys.modules) - before:
            if name.startswith(_FILE_MODULE_PREFIX):
                del sys.modules[name]


def _import_file(path: Path):
    """Import a model file (inside ``_importable``, with its folder importable like ``python file.py``)."""
    if not path.is_file():
        raise InputError(f"MODEL file {str(path)!r} does not exist (looked in {Path.cwd()}); give a path to a .py file")
    name = f"{_FILE_MODULE_PREFIX}{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickling look the defining module up by name
    try:
        spec.loader.exec_module(module)
    except Exception as e:  # user code: any failure means "could not load the model file"
        del sys.modules[name]
        raise InputError(f"importing {path} failed: {type(e).__name__}: {_first_line(e)}") from e
    return module


def _import_module(name: str):
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        raise InputError(f"cannot import module {name!r} ({_first_line(e)}); run from the folder that holds it, "
                         f"or give a file path (path/to/file.py:factory)") from e
    except Exception as e:  # user code raised while importing
        raise InputError(f"importing {name} failed: {type(e).__name__}: {_first_line(e)}") from e


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def _message(e: BaseException) -> str:
    """An exception in one line, with its cause's (validation errors put the reason there)."""
    text = " ".join(str(e).split()) or type(e).__name__
    cause = e.__cause__
    return f"{text} ({type(cause).__name__}: {' '.join(str(cause).split())})" if cause and str(cause) not in text else text


def _failed_line(e: BaseException) -> str:
    """For an exception with no message (a bare ``assert``), the source line that raised it."""
    if str(e).strip():
        return _first_line(e)
    frames = traceback.extract_tb(e.__traceback__)
    if not frames:
        return type(e).__name__
    last = frames[-1]
    return f"{(last.line or '').strip()} failed (at {Path(last.filename).name}:{last.lineno})"


def _defined_names(module) -> str:
    names = [n for n, v in vars(module).items()
             if not n.startswith("_") and callable(v) and getattr(v, "__module__", None) == module.__name__]
    return ", ".join(sorted(names)) or "no callables"


def _resolve(module, attr: str, where: str):
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise InputError(f"{where} does not define {attr!r}; it defines: {_defined_names(module)}. "
                             f"Write MODEL as {where}:<one of those>")
        obj = getattr(obj, part)
    return obj


def _call_factory(obj, spec: ModelSpec) -> nn.Module:
    if isinstance(obj, nn.Module):
        if spec.overrides:
            raise InputError(f"{spec} is a model instance, so --set has nothing to pass; name a factory instead")
        return obj
    if not callable(obj):
        raise InputError(f"{spec} is a {type(obj).__name__}, not a model, a model class or a factory function")
    try:
        model = obj(**dict(spec.overrides))
    except Exception as e:  # user code: report it in one line, with the fix when it is ours to give
        hint = "; pass the factory's arguments with --set name=value" if isinstance(e, TypeError) else ""
        raise InputError(f"building the model with {spec}(...) failed: {type(e).__name__}: {_failed_line(e)}"
                         f"{hint}") from e
    if not isinstance(model, nn.Module):
        raise InputError(f"{spec}(...) returned a {type(model).__name__}, not a torch.nn.Module")
    return model


def _hf():
    try:
        import transformers
    except ImportError as e:
        raise InputError("hf: models need transformers; install it with pip install 'autotp[hf]'") from e
    return transformers


@contextlib.contextmanager
def quiet_transformers(transformers):
    """Config and init warnings would bury our one-line errors: quiet transformers while building, then
    restore its verbosity."""
    previous = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        yield
    finally:
        transformers.logging.set_verbosity(previous)


def _known_keys(config) -> set[str]:
    return set(config.to_dict()) | set(getattr(config, "attribute_map", {}))


def _check_keys(config, overrides: dict, where: str) -> None:
    unknown = sorted(set(overrides) - _known_keys(config))
    if unknown:
        close = difflib.get_close_matches(unknown[0], sorted(_known_keys(config)), n=3)
        hint = f" (did you mean {', '.join(close)}?)" if close else ""
        raise InputError(f"--set {unknown[0]}: the {where} config has no field {unknown[0]!r}{hint}")


SMALL_LOW_RANK = {"kv_lora_rank": 32, "q_lora_rank": 48, "qk_rope_head_dim": 16, "qk_nope_head_dim": 16,
                  "v_head_dim": 16, "qk_head_dim": 32}
"""The sizes of a low-rank (DeepSeek MLA) attention in the small config."""


def _small_low_rank(fields: dict, small: dict) -> dict:
    """Small low-rank attention sizes for a config that has them (``kv_lora_rank``), else nothing."""
    if not fields.get("kv_lora_rank"):
        return {}
    # a size of 0 switches its part off (no rotary part: NoPE layers), and stays off
    out = {k: v for k, v in SMALL_LOW_RANK.items() if fields.get(k) is not None and fields.get(k) != 0}
    # head_dim means one of the low-rank sizes (the rotary part, or the whole query head): keep it that one.
    same = [k for k in ("qk_rope_head_dim", "qk_head_dim", "v_head_dim") if k in out and fields[k] == fields.get("head_dim")]
    if same and "head_dim" in small:
        out["head_dim"] = out[same[0]]
    if "num_key_value_heads" in small:  # keys and values are made per query head: as many KV heads as heads
        out["num_key_value_heads"] = small["num_attention_heads"]
    return out


def hf_config(spec: ModelSpec):
    """The transformers config a ``hf:`` spec names, small defaults and ``--set`` values applied."""
    transformers = _hf()
    with quiet_transformers(transformers):
        return _hf_config(transformers, spec)


def _hf_config(transformers, spec: ModelSpec):
    overrides = dict(spec.overrides)
    if spec.kind is SpecKind.HF_TYPE:
        known = sorted(transformers.CONFIG_MAPPING.keys())
        if spec.target not in known:
            close = difflib.get_close_matches(spec.target, known, n=3)
            hint = f"; did you mean {', '.join(close)}?" if close else "; see transformers' CONFIG_MAPPING"
            raise InputError(f"transformers has no model type {spec.target!r}{hint}")
        default = transformers.AutoConfig.for_model(spec.target)
        _check_keys(default, overrides, spec.target)
        fields = default.to_dict()
        small = {k: v for k, v in SMALL_HF.items() if k in fields}
        small |= _small_low_rank(fields, small)
        vocab = overrides.get("vocab_size", small.get("vocab_size"))
        # Special token ids of the full vocabulary (a padding index, say) would not fit the small one.
        small |= {k: None for k in ("pad_token_id", "bos_token_id", "eos_token_id")
                  if isinstance(fields.get(k), int) and vocab is not None and fields[k] >= vocab}
        # Passed at construction so derived fields (head_dim, per-layer lists) follow the small sizes.
        return _config_for(transformers, spec, spec.target, **(small | overrides))
    path = Path(spec.target)
    if not path.exists():
        raise InputError(f"hf config {spec.target!r} does not exist; give a config.json or a folder holding one")
    try:
        config = transformers.AutoConfig.from_pretrained(str(path))
    except (OSError, ValueError) as e:
        raise InputError(f"cannot read the Hugging Face config {spec.target}: {_first_line(e)}") from e
    if not overrides:
        return config
    _check_keys(config, overrides, spec.target)
    fields = config.to_dict() | overrides
    if "num_hidden_layers" in overrides:
        fields.pop("layer_types", None)  # a per-layer list sized for the old depth; rebuilt from the new one
    return _config_for(transformers, spec, **fields)


def _config_for(transformers, spec: ModelSpec, *args, **fields):
    """``AutoConfig.for_model``, its validation errors (a field of the wrong type, heads that do not divide
    the width) reported in one line."""
    try:
        return transformers.AutoConfig.for_model(*args, **fields)
    except Exception as e:  # transformers and huggingface_hub raise many types for values a config rejects
        raise InputError(f"the {spec} config rejects these values: {_message(e)}; fix the --set values") from e


def _hf_model(spec: ModelSpec, weights: bool) -> nn.Module:
    transformers = _hf()
    config = hf_config(spec)
    causal = config.model_type in transformers.models.auto.modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    auto = transformers.AutoModelForCausalLM if causal else transformers.AutoModel
    try:
        with torch.device("cpu" if weights else "meta"), quiet_transformers(transformers):
            return auto.from_config(config)
    except Exception as e:  # transformers raises many types for configs it cannot build
        raise InputError(f"transformers cannot build {spec} from its config: {type(e).__name__}: {_first_line(e)}; "
                         "fix the config or the --set values") from e


def build_model(spec: ModelSpec, weights: bool = False) -> nn.Module:
    """The model a spec names (weights seeded, so building twice gives the same model).

    ``hf:`` models are built on the meta device (planning needs shapes only) unless ``weights``. Leaves the
    process as it found it: torch's global RNG state, ``sys.path`` and ``sys.modules``.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        if spec.kind in (SpecKind.HF_TYPE, SpecKind.HF_CONFIG):
            return _hf_model(spec, weights)
        # The current directory is importable, as under `python -m` (console scripts start elsewhere);
        # a file's own folder too, as under `python file.py`, so its sibling imports work.
        folders = [str(Path.cwd())] + ([str(Path(spec.target).resolve().parent)] if spec.kind is SpecKind.FILE else [])
        with _importable(*folders):
            if spec.kind is SpecKind.FILE:
                module = _import_file(Path(spec.target))
            else:
                module = _import_module(spec.target)
            return _call_factory(_resolve(module, spec.attr, spec.target), spec)


def example_inputs(model: nn.Module, vocab: int | None = None) -> tuple[torch.Tensor]:
    """Token ids to capture ``model`` with, on the device its parameters live on (meta for ``hf:``): the ids
    ``autotp.plan`` synthesises when given no inputs (``--vocab-size`` overrides the model's vocabulary)."""
    return synthesise(model, vocab).flat
