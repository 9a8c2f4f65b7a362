"""The inputs a model is captured with and later called with: named, ordered, checked, or synthesised.

Users give example inputs as Hugging Face users call models: a tensor, a tuple of positional tensors, or a
dict of keyword tensors (``{"input_ids": ids, "attention_mask": mask, "labels": labels}``). Each input gets
the name of the forward parameter it binds to, so a call may pass it either way (``pm(ids)`` and
``pm(input_ids=ids)`` are one call). The captured graph takes them flat, in the order the example gave them.
When no example is given, token ids are synthesised from the model's vocabulary (the CLI does the same).
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from autotp.errors import InputError

EXAMPLE_BATCH = 2
EXAMPLE_SEQ = 32
"""The size of synthesised token ids. Batch and sequence stay dynamic in the capture, so these only need
to be ordinary: above 1 (torch.export specialises sizes 0 and 1) and within any position table."""

FORMS = ("example_inputs=(input_ids,) (positional tensors) or "
         "example_inputs={'input_ids': ids, 'attention_mask': mask} (keyword tensors)")


@dataclass(frozen=True)
class Signature:
    """What a model's forward accepts, as far as naming inputs needs."""

    positional: tuple[str, ...]
    """Parameters a positional input binds to, in order."""
    keywords: frozenset[str]
    """Parameters an input may name."""
    var_positional: bool = False
    """Whether the forward takes ``*args`` (extra positional inputs are named ``args[i]``)."""
    var_keyword: bool = False
    """Whether the forward takes ``**kwargs`` (any keyword is accepted)."""
    none_default: frozenset[str] = frozenset()
    """Parameters whose default is None: passing None for them is passing nothing."""

    @classmethod
    def of(cls, model: nn.Module) -> Signature:
        """The signature of ``model.forward``."""
        try:
            params = inspect.signature(model.forward).parameters.values()
        except (TypeError, ValueError):  # a forward Python cannot inspect (compiled): name inputs by position
            return cls((), frozenset(), var_positional=True, var_keyword=True)
        kinds = inspect.Parameter
        positional = tuple(p.name for p in params if p.kind in (kinds.POSITIONAL_ONLY, kinds.POSITIONAL_OR_KEYWORD))
        keywords = frozenset(p.name for p in params if p.kind in (kinds.POSITIONAL_OR_KEYWORD, kinds.KEYWORD_ONLY))
        return cls(positional, keywords, any(p.kind is kinds.VAR_POSITIONAL for p in params),
                   any(p.kind is kinds.VAR_KEYWORD for p in params),
                   frozenset(p.name for p in params if p.default is None))


def name_inputs(signature: Signature, args: tuple, kwargs: Mapping, what: str = "the call") -> dict[str, object]:
    """Every input under the name of the parameter it binds to: positional ones first, then keyword ones in
    the order given. A keyword None whose default is None is dropped (it means "not given")."""
    named: dict[str, object] = {}
    for i, value in enumerate(args):
        if i < len(signature.positional):
            named[signature.positional[i]] = value
        elif signature.var_positional:
            named[f"args[{i}]"] = value
        else:
            raise InputError(f"{what} passes {len(args)} positional inputs but the model's forward takes at most "
                             f"{len(signature.positional)} ({', '.join(signature.positional)}); pass the rest by name")
    for name, value in kwargs.items():
        if not isinstance(name, str):
            raise InputError(f"{what} names an input {name!r}; keyword input names are strings, like 'input_ids'")
        if name in named:
            raise InputError(f"{what} gives {name!r} twice, positionally and by keyword; give it once")
        if name not in signature.keywords and not signature.var_keyword:
            raise InputError(f"{what} passes {name}=, which the model's forward does not take; it takes "
                             f"{', '.join(sorted(signature.keywords)) or 'no keyword inputs'}")
        if value is None and name in signature.none_default:
            continue
        named[name] = value
    return named


@dataclass(frozen=True, eq=False)
class ExampleInputs:
    """Example inputs in the order the captured graph takes them: positional ones, then keyword ones."""

    args: tuple[torch.Tensor, ...]
    kwargs: tuple[tuple[str, torch.Tensor], ...] = ()
    """Keyword inputs, in the order given."""
    names: tuple[str, ...] = ()
    """Every input's name (the forward parameter it binds to), in the graph's order."""
    synthesised: str = ""
    """How the inputs were made when the user gave none ('' when the user gave them)."""

    @property
    def flat(self) -> tuple[torch.Tensor, ...]:
        """Every input tensor, in the graph's order."""
        return self.args + tuple(value for _, value in self.kwargs)

    def call(self, model: nn.Module, fixed: Mapping | None = None):
        """``model`` called on these inputs as the user would (positional and keyword), plus ``fixed`` keywords."""
        return model(*self.args, **dict(self.kwargs), **(fixed or {}))


def example_inputs_of(model: nn.Module, example_inputs) -> ExampleInputs:
    """The example inputs as given (a tensor, a tuple or list, a dict of keyword tensors), named and checked;
    synthesised token ids when ``example_inputs`` is None. An ``ExampleInputs`` is returned as it is."""
    if isinstance(example_inputs, ExampleInputs):
        return example_inputs
    require_module(model)
    if example_inputs is None:
        return synthesise(model)
    args, kwargs = _split(example_inputs)
    signature = Signature.of(model)
    _check_tensors(args, kwargs, signature)
    named = name_inputs(signature, args, kwargs, "example_inputs")
    if not named:
        raise InputError(f"example_inputs holds no tensors; pass {FORMS}, or leave example_inputs out to have "
                         "token ids made from the model's vocabulary")
    keyword = tuple((k, v) for k, v in named.items() if k in kwargs)
    return ExampleInputs(args, keyword, tuple(named))


def _split(example_inputs) -> tuple[tuple, dict]:
    """The positional and keyword parts of example inputs given as a tensor, a tuple or list, or a dict."""
    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,), {}
    if isinstance(example_inputs, Mapping) and example_inputs:
        return (), dict(example_inputs)
    if isinstance(example_inputs, (tuple, list)) and example_inputs:
        return tuple(example_inputs), {}
    empty = isinstance(example_inputs, (Mapping, tuple, list))
    got = f"an empty {type(example_inputs).__name__}" if empty else type(example_inputs).__name__
    raise InputError(f"example_inputs must be a tensor or a non-empty tuple of tensors, or a dict of keyword "
                     f"tensors, got {got}; pass {FORMS}, or leave example_inputs out to have token ids made "
                     "from the model's vocabulary")


def _check_tensors(args: tuple, kwargs: dict, signature: Signature) -> None:
    """``InputError`` naming the first example input that is not a tensor (None is allowed by keyword where
    it is the default: it means "not given")."""
    given = [(f"example_inputs[{i}]", x) for i, x in enumerate(args)]
    given += [(f"example_inputs[{k!r}]", x) for k, x in kwargs.items()
              if not (x is None and k in signature.none_default)]
    for where, value in given:
        if not isinstance(value, torch.Tensor):
            raise InputError(f"{where} is a {type(value).__name__}, not a torch.Tensor; pass the tensors the "
                             f"model's forward takes, as {FORMS} (options like use_cache are not inputs)")


def require_module(model) -> None:
    """``InputError`` unless ``model`` is an ``nn.Module`` (before anything reads its forward or parameters)."""
    if not isinstance(model, nn.Module):
        raise InputError(f"model must be a torch.nn.Module, got {type(model).__name__}")


def vocab_size(model: nn.Module) -> int:
    """The model's vocabulary: ``config.vocab_size``, else the smallest of its sub-configs' (an encoder-decoder's
    encoder and decoder, a vision-language model's text config), else the largest ``nn.Embedding``'s size."""
    config = getattr(model, "config", None)
    size = getattr(config, "vocab_size", None)
    if isinstance(size, int) and size > 0:
        return size
    sizes = [s for s in map(_vocab_of, vars(config).values() if config is not None else ()) if s]
    if sizes:  # ids below the smallest index every table the ids may reach (a largest table may be positions)
        return min(sizes)
    embeddings = [m.num_embeddings for m in model.modules() if isinstance(m, nn.Embedding)]
    if embeddings:
        return max(embeddings)
    raise InputError(f"cannot guess the inputs of {type(model).__name__}: it has no config.vocab_size and no "
                     f"nn.Embedding to draw token ids from; pass {FORMS} (on the command line: --vocab-size N)")


def _vocab_of(sub_config) -> int | None:
    """A sub-config's vocabulary (None for a value that is not a config with one)."""
    size = getattr(sub_config, "vocab_size", None) if hasattr(sub_config, "to_dict") else None
    return size if isinstance(size, int) and not isinstance(size, bool) and size > 0 else None


def _streams(model: nn.Module) -> int:
    """Rows of token ids per sample: one per table of the model's input embedding where it is a list of them (a
    decoder over parallel codebooks of audio codes, MusicGen's, embeds each codebook's row with its own table and
    reads ``batch x codebooks`` rows), else one."""
    try:
        tables = model.get_input_embeddings()
    except (AttributeError, NotImplementedError):  # not a transformers model, or one without input embeddings
        return 1
    if isinstance(tables, nn.ModuleList) and tables and all(isinstance(t, nn.Embedding) for t in tables):
        return len(tables)
    return 1


def synthesise(model: nn.Module, vocab: int | None = None) -> ExampleInputs:
    """Token ids (EXAMPLE_BATCH x EXAMPLE_SEQ, below ``vocab``, default the model's vocabulary) on the device
    of the model's parameters (meta for a model built there); the same ids on every call and every rank."""
    vocab = vocab or vocab_size(model)
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    rows = EXAMPLE_BATCH * _streams(model)
    ids = torch.randint(0, vocab, (rows, EXAMPLE_SEQ), generator=torch.Generator().manual_seed(0))
    signature = Signature.of(model)
    name = signature.positional[0] if signature.positional else "args[0]"
    note = (f"example inputs synthesised: token ids of shape ({rows}, {EXAMPLE_SEQ}) below the vocabulary "
            f"size {vocab}, passed as {name}; batch and sequence stay dynamic")
    return ExampleInputs((ids.to(device),), (), (name,), note)
