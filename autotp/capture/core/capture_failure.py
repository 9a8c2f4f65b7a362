"""Why a capture failed, said once and in the user's terms.

``capture`` tries torch.export with dynamic sizes, then static, then the fallbacks for data-dependent branches;
when all fail, the error names the likeliest cause it can tell from the failure: floating-point inputs where token
ids were wanted, a forward writing into its own weights, a training-only branch a setting switches on, else the
static attempt's own first line and the user's line it broke at.
"""

from __future__ import annotations

import os
import traceback
from typing import NoReturn

import torch
from torch import nn

from autotp.capture.core.examples import ExampleInputs
from autotp.capture.fallbacks.guards import training_branch_settings, training_setting_error
from autotp.errors import CaptureError, InputError


def raise_capture_failure(model: nn.Module, example: ExampleInputs, errors: list[tuple[bool | None, Exception]],
                          training: bool | None) -> NoReturn:
    """Raise the error for a capture of ``model`` on ``example`` that failed with ``errors`` (whether the attempt
    was dynamic, or None for the branch-taking fallback, and what it raised), captured for ``training`` (None: in
    the mode the model is in)."""
    config = getattr(model, "config", None)  # a transformers model's settings, which a refusal may name
    fallback = next((e for dynamic, e in errors if dynamic is None), None)
    _, err = [(d, e) for d, e in errors if d is not None][-1]
    _refuse_float_ids(example, err)
    first_line = (str(err).strip().splitlines() or [type(err).__name__])[0]
    settings = training_branch_settings(err, config)
    if settings:  # the failure is in training-only code a setting switches on: that setting is the fix
        raise training_setting_error(settings, f"{type(model).__name__} failed in a branch it takes only in "
                                     f"training with {', '.join(settings)} set (data-dependent, as augmentation "
                                     f"is): {type(err).__name__}: {first_line[:200]} (at {_user_frame(err)})"
                                     ) from err
    made = (" No example_inputs were given, so the model ran on synthesised token ids, which it may not take; "
            "pass its inputs as example_inputs." if example.synthesised else "")
    raise CaptureError(
        f"could not capture {type(model).__name__}: torch.export.export(strict=False) failed with dynamic and "
        f"with static shapes; the static attempt said: {type(err).__name__}: {first_line} (at {_user_frame(err)}). "
        "Make the forward traceable (no data-dependent Python control flow on tensor values, no .item()), "
        f"or pass example_inputs the forward accepts (a tuple of positional tensors or a dict of keyword ones).{made}"
        + (f" (Capturing the branches the example takes failed too: {type(fallback).__name__}: "
           f"{(str(fallback).strip().splitlines() or [''])[0][:200]})" if fallback is not None else "")
    ) from err


def _user_frame(exc: BaseException) -> str:
    """The innermost traceback frame outside torch and autotp, i.e. where in the user's code capture broke."""
    torch_dir = os.path.dirname(torch.__file__)
    here = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))  # autotp/: its capture wraps the forward
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if not f.filename.startswith((torch_dir, here))]
    if not frames:
        return "inside torch"
    f = frames[-1]
    return f"{f.filename}:{f.lineno} in {f.name}"


def _refuse_float_ids(example: ExampleInputs, err: Exception) -> None:
    """Floating-point example inputs where an embedding wanted token ids: a mistake in the inputs, said in one
    line (the export's own chain of errors is long and its advice, to make the forward traceable, is wrong)."""
    floats = [name for name, x in zip(example.names, example.flat) if x.is_floating_point()]
    if floats and "'indices'" in str(err):
        raise InputError(f"example input {floats[0]} is a {example.flat[example.names.index(floats[0])].dtype} "
                         "tensor, but the model looks it up in an embedding, which takes integer token ids: pass "
                         "torch.long ids (ids.long())") from None


