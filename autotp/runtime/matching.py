"""Whether a checkpoint fits a model: every tensor's shape and dtype, and which tensors it lacks.

Checked before anything is read, on every load path (``parallelize(checkpoint=)`` and ``pm.load``, DCP and
safetensors), with one ``CheckpointError`` listing every mismatch: a checkpoint of a bigger model must not
load the top-left corner of each tensor, nor fail on the first of fifty. Values are cast to the model's dtype
within a kind (bfloat16 into float32 is a load); a float checkpoint tensor for an integer buffer is not.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from autotp.errors import CheckpointError

_SAFETENSORS_DTYPES = {"BOOL": "bool", "U8": "uint8", "I8": "int8", "U16": "uint16", "I16": "int16",
                       "U32": "uint32", "I32": "int32", "U64": "uint64", "I64": "int64", "F16": "float16",
                       "BF16": "bfloat16", "F32": "float32", "F64": "float64", "F8_E4M3": "float8_e4m3fn",
                       "F8_E5M2": "float8_e5m2", "C64": "complex64"}


@dataclass(frozen=True)
class Expected:
    """A tensor the model has, as a checkpoint should hold it."""

    name: str
    """The model's name for it (the first of its names, for a tied tensor)."""
    names: tuple[str, ...]
    """Every name the checkpoint may hold it under (a tied weight has several)."""
    shape: tuple[int, ...]
    dtype: torch.dtype
    required: bool
    """Whether a strict load needs it (a parameter or a buffer the model's state dict holds)."""
    meta: bool = False
    """Whether the model has no values for it (on the meta device): needed whatever ``strict`` says."""
    buffer: bool = False


def dtype_name(dtype) -> str:
    """``torch.float32`` -> ``float32``; a safetensors code (``BF16``) -> its torch name."""
    if isinstance(dtype, torch.dtype):
        return str(dtype).removeprefix("torch.")
    return _SAFETENSORS_DTYPES.get(str(dtype), str(dtype).lower())


def _kind(name: str) -> str:
    if name == "bool":
        return "bool"
    if name.startswith("complex"):
        return "complex"
    return "float" if name.startswith(("float", "bfloat")) else "integer"


def _listing(items: list[str]) -> str:
    return ", ".join(items)


def match(expected: list[Expected], shapes: dict[str, tuple], dtypes: dict[str, str], where: str,
          strict: bool) -> dict[str, str]:
    """Each expected tensor's name -> the name ``where`` holds it under (``shapes``/``dtypes`` by checkpoint name).

    One ``CheckpointError`` lists every tensor of another shape, of another kind of dtype, and (unless
    ``strict`` is False) every required tensor the checkpoint lacks; tensors with no values (meta) are needed
    even when not ``strict``."""
    found: dict[str, str] = {}
    wrong_shape, wrong_dtype, missing, no_values = [], [], [], []
    for want in expected:
        hit = next((n for n in want.names if n in shapes), None)
        if hit is None:
            if want.meta:
                no_values.append(want)
            elif want.required and strict:
                missing.append(want.name)
            continue
        found[want.name] = hit
        if tuple(shapes[hit]) != tuple(want.shape):
            wrong_shape.append(f"{hit} {list(shapes[hit])} (the model's: {list(want.shape)})")
        saved, own = dtype_name(dtypes.get(hit, want.dtype)), dtype_name(want.dtype)
        if _kind(saved) != _kind(own):
            wrong_dtype.append(f"{hit} {saved} (the model's: {own})")
    parts = []
    if wrong_shape:
        parts.append(f"{len(wrong_shape)} tensor(s) of another shape: {_listing(wrong_shape)}")
    if wrong_dtype:
        parts.append(f"{len(wrong_dtype)} tensor(s) of another kind of dtype: {_listing(wrong_dtype)}")
    if missing:
        parts.append(f"{len(missing)} tensor(s) of the model missing: {_listing(missing)}")
    if no_values:
        parts.append(_no_values(no_values))
    if parts:
        fixes = []
        if wrong_shape or wrong_dtype:
            fixes.append("Build the model from the checkpoint's config, or pass this model's checkpoint.")
        if missing:
            fixes.append("Pass strict=False to keep the model's own values for the missing tensors.")
        raise CheckpointError(f"{where} does not fit the model: {'; '.join(parts)}. {' '.join(fixes)}".rstrip())
    return found


def _no_values(wants: list[Expected]) -> str:
    """The meta tensors a checkpoint lacks, buffers apart, with what to do about them."""
    kinds = [("buffer(s)", [w.name for w in wants if w.buffer]),
             ("parameter(s)", [w.name for w in wants if not w.buffer])]
    listing = "; ".join(f"{len(names)} {kind}: {_listing(names)}" for kind, names in kinds if names)
    return (f"the model has tensors on the meta device (no values) that it does not hold: {listing}. Buffers computed "
            "at construction (rotary inv_freq, masks) are not saved in checkpoints: build the model under "
            "autotp.empty_weights() or accelerate's init_empty_weights() (both keep buffers real), or give these "
            "tensors values before parallelize; parameters must be in the checkpoint (check its names)")
