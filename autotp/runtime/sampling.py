"""Choosing the next token as Hugging Face's ``generate`` does: the settings, their defaults, and the draws.

The logits processing repeats transformers' warpers op for op (temperature, then top-k, then top-p; greedy takes
the argmax), and a draw is ``torch.multinomial`` on the softmax, so with the same generator state the tokens are
the ones ``model.generate`` picks in one process.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from autotp.errors import InputError

#: transformers' own defaults for what a generation_config leaves unset (GenerationConfig's defaults).
_DEFAULTS = {"max_new_tokens": 20, "do_sample": False, "temperature": 1.0, "top_k": 50, "top_p": 1.0}

#: Settings of a generation_config that change the tokens and that autotp does not implement, with their no-op values.
_UNSUPPORTED = {"num_beams": 1, "repetition_penalty": 1.0, "no_repeat_ngram_size": 0, "min_length": 0,
                "min_new_tokens": None, "bad_words_ids": None, "suppress_tokens": None, "begin_suppress_tokens": None,
                "forced_bos_token_id": None, "forced_eos_token_id": None, "typical_p": 1.0, "min_p": None,
                "epsilon_cutoff": 0.0, "eta_cutoff": 0.0, "top_h": None, "num_return_sequences": 1}


#: generate arguments that change nothing autotp computes, with the values that keep it so (None: any value).
_NEUTRAL = {"use_cache": None, "output_attentions": False, "output_hidden_states": False, "output_scores": False,
            "streamer": None, "synced_gpus": None, "return_legacy_cache": None}

_BEAM_ONLY = ("length_penalty", "early_stopping", "num_beam_groups", "diversity_penalty")
"""Beam search's own settings: they change nothing without ``num_beams`` > 1 (which is refused)."""


def check_extra(kwargs: dict) -> None:
    """Refuse, with what to change, any other ``generate`` argument than those autotp implements: a setting it
    does not implement (beam search, a repetition penalty, ...) unless at its no-op value, an argument that
    changes nothing (``use_cache``) at any value it can take, and anything else."""
    for name, value in kwargs.items():
        if name in _UNSUPPORTED:
            if value is not None and value != _UNSUPPORTED[name]:
                what = " (beam search)" if name == "num_beams" else ""
                raise InputError(f"generate({name}={value!r}){what} is not implemented by autotp's generate, which "
                                 f"decodes greedily or by sampling; leave {name} out (or {_UNSUPPORTED[name]!r})")
        elif name in _NEUTRAL:
            if _NEUTRAL[name] is not None and value not in (None, _NEUTRAL[name]):
                raise InputError(f"generate({name}={value!r}) is not implemented by autotp's generate; leave it out")
        elif name not in _BEAM_ONLY:
            raise InputError(f"generate does not take {name}=; autotp's generate takes input_ids, attention_mask, "
                             "max_new_tokens, do_sample, temperature, top_k, top_p, eos_token_id, pad_token_id, "
                             "generation_config, return_dict_in_generate and output_logits")


@dataclass(frozen=True)
class Settings:
    """How tokens are chosen and when a sequence stops."""

    max_new_tokens: int
    do_sample: bool
    temperature: float
    top_k: int
    top_p: float
    eos: tuple[int, ...]
    """Token ids that end a sequence (none: every sequence runs max_new_tokens)."""
    pad: int | None
    """What a finished sequence is padded with."""

    def __post_init__(self):
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise InputError(f"max_new_tokens must be a positive integer, got {self.max_new_tokens!r}")
        if self.do_sample and not self.temperature > 0:
            raise InputError(f"temperature must be above 0 when sampling, got {self.temperature!r}; use "
                             "do_sample=False for greedy decoding")
        if not 0 < self.top_p <= 1:
            raise InputError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.eos and self.pad is None:
            raise InputError("eos_token_id is set but pad_token_id is not: pass pad_token_id= (what a finished "
                             "sequence is filled with)")


def _ids(value) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, torch.Tensor):
        return tuple(int(v) for v in value.flatten())
    return tuple(int(v) for v in value) if isinstance(value, (list, tuple)) else (int(value),)


def resolve(config, given: dict) -> Settings:
    """The settings: each given argument, else the model's ``generation_config`` (None: none), else transformers'
    defaults. A config setting autotp does not implement (beam search, repetition penalty, ...) is refused."""
    for name, neutral in _UNSUPPORTED.items():
        value = getattr(config, name, None)
        if value is not None and value != neutral:
            raise InputError(f"the model's generation_config sets {name}={value!r}, which autotp's generate does not "
                             f"implement; set generation_config.{name} = {neutral!r} to generate without it")

    def pick(name):
        if given.get(name) is not None:
            return given[name]
        value = getattr(config, name, None)
        return value if value is not None else _DEFAULTS.get(name)

    max_new = pick("max_new_tokens")
    eos = _ids(pick("eos_token_id"))
    pad = pick("pad_token_id")
    pad = int(pad) if pad is not None else (eos[0] if eos else None)  # transformers pads with the first EOS too
    return Settings(max_new, bool(pick("do_sample")), float(pick("temperature")), int(pick("top_k") or 0),
                    float(pick("top_p")), eos, pad)


def process(scores: torch.Tensor, s: Settings) -> torch.Tensor:
    """Sampling's logits processing, as transformers' warpers do it (float32 scores ``[batch, vocab]``)."""
    if s.temperature != 1.0:
        scores = scores / s.temperature
    if s.top_k:
        k = min(s.top_k, scores.size(-1))
        scores = scores.masked_fill(scores < torch.topk(scores, k)[0][..., -1, None], -float("inf"))
    if s.top_p < 1.0:
        ordered, order = torch.sort(scores, descending=False)
        drop = ordered.softmax(dim=-1).cumsum(dim=-1) <= (1 - s.top_p)
        drop[..., -1:] = 0  # keep at least one token
        scores = scores.masked_fill(drop.scatter(1, order, drop), -float("inf"))
    return scores


def choose(logits: torch.Tensor, s: Settings, generator: torch.Generator | None) -> torch.Tensor:
    """The next token of each sequence from its last logits ``[batch, vocab]``."""
    scores = logits.to(dtype=torch.float32)
    if not s.do_sample:
        return torch.argmax(scores, dim=-1)
    probs = torch.softmax(process(scores, s), dim=-1)
    return torch.multinomial(probs, num_samples=1, generator=generator).squeeze(1)
