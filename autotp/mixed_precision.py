"""The mixed-precision policy: bf16 compute over fp32 master weights, as FSDP2's ``MixedPrecisionPolicy`` says it.

``MixedPrecision(compute_dtype="bfloat16")`` runs the rank graphs under ``torch.autocast(bfloat16)`` while the
parameters, their gradients and the optimizer stay in fp32 (the way mixed-precision training is done).
``param_dtype`` also casts the parameters for the forward (FSDP2's meaning: gradients flow back through the cast
to the fp32 parameters), ``reduce_dtype`` the gradients for their reduction over data-parallel replicas. The
policy is a value: dtypes are kept as their names ("bfloat16"), so a plan file records it as JSON.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from autotp.errors import InputError

DTYPES = ("float32", "bfloat16", "float16")
"""The dtypes a policy names (torch's names, without ``torch.``; torch is imported only when one is used, as
``Options`` is imported by ``autotp --help``)."""


def _torch_dtype(name: str | None):
    import torch

    return getattr(torch, name) if name is not None else None


def _is_torch_dtype(value) -> bool:
    return type(value).__module__ == "torch" and type(value).__name__ == "dtype"


def dtype_name(value, field: str) -> str | None:
    """``value`` (a torch dtype or its name, or None) as a name in ``DTYPES``, else an ``InputError`` naming
    ``field`` and the choices."""
    if value is None:
        return None
    name = str(value).removeprefix("torch.") if isinstance(value, str) or _is_torch_dtype(value) else None
    if name not in DTYPES:
        raise InputError(f"mixed_precision.{field} must be one of {sorted(DTYPES)} (or the torch dtype), got "
                         f"{value!r}")
    return name


@dataclass(frozen=True)
class MixedPrecision:
    """Which dtypes a parallel module computes, holds and reduces in (each None: unchanged, as stored). The
    parameters themselves stay as stored (fp32 master weights): the optimizer updates them."""

    compute_dtype: str | None = "bfloat16"
    """The dtype the rank graphs run under ``torch.autocast`` in: matmuls and the other ops autocast lists compute
    in it, the rest (norms, softmax, the loss) in fp32. None: as ``param_dtype`` (FSDP2 computes in that)."""
    param_dtype: str | None = None
    """The dtype the parameters are cast to for the forward and backward (FSDP2's ``param_dtype``; their
    gradients are cast back to the parameters' dtype). None: used as stored."""
    reduce_dtype: str | None = None
    """The dtype gradients are averaged over data-parallel replicas in (FSDP2's ``reduce_dtype``; the all-reduce
    under ``dp_mode='replicate'``). None: the gradients' own dtype."""

    def __post_init__(self):
        for f in dataclasses.fields(self):
            object.__setattr__(self, f.name, dtype_name(getattr(self, f.name), f.name))

    @property
    def compute(self):
        """The autocast dtype (``compute_dtype``, else ``param_dtype``) as a torch dtype; None: no autocast."""
        return _torch_dtype(self.compute_dtype or self.param_dtype)

    @property
    def param(self):
        """``param_dtype`` as a torch dtype."""
        return _torch_dtype(self.param_dtype)

    @property
    def reduce(self):
        """``reduce_dtype`` as a torch dtype."""
        return _torch_dtype(self.reduce_dtype)

    @staticmethod
    def autocast_of(policy: MixedPrecision | None, device: str = "cpu"):
        """``torch.autocast`` on ``device`` to ``policy``'s compute dtype; a context doing nothing without one."""
        import contextlib

        import torch

        dtype = policy.compute if policy is not None else None
        return torch.autocast(device, dtype=dtype) if dtype is not None else contextlib.nullcontext()

    def to_dict(self) -> dict:
        """A JSON-ready dict."""
        return dataclasses.asdict(self)

    @classmethod
    def of(cls, value) -> MixedPrecision | None:
        """A policy from what a user passes: a ``MixedPrecision``, a dict of its fields (a plan file's), a dtype
        or its name (bf16 compute), torch's FSDP2 ``MixedPrecisionPolicy``, or None."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, dict):
            unknown = sorted(set(value) - {f.name for f in dataclasses.fields(cls)})
            if unknown:
                raise InputError(f"unknown mixed_precision field(s) {', '.join(map(str, unknown))}; the fields are "
                                 f"{', '.join(f.name for f in dataclasses.fields(cls))}")
            return cls(**value)
        if isinstance(value, str) or _is_torch_dtype(value):
            return cls(compute_dtype=value)
        if type(value).__name__ == "MixedPrecisionPolicy" and hasattr(value, "param_dtype"):
            return _from_fsdp_policy(value)
        raise InputError(f"mixed_precision must be an autotp.MixedPrecision (or a dtype for bf16 compute, or "
                         f"torch's FSDP2 MixedPrecisionPolicy), got {type(value).__name__}")


def _from_fsdp_policy(policy) -> MixedPrecision:
    """FSDP2's policy as ours: its param_dtype is the compute dtype too; output casts are not offered."""
    if getattr(policy, "output_dtype", None) is not None:
        raise InputError("MixedPrecisionPolicy.output_dtype is not supported: the parallel module's outputs keep "
                         "the dtype the graph computes them in; leave output_dtype None")
    return MixedPrecision(compute_dtype=None, param_dtype=policy.param_dtype, reduce_dtype=policy.reduce_dtype)
