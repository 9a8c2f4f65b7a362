"""Replicated parameters that drift apart across the tensor-parallel ranks, caught at the next forward.

A parameter every tp rank holds whole (a norm's weight, a row-parallel bias) must stay identical on every rank:
each rank computes the same gradient for it and steps it alike. A rank whose update differs (gradients clipped by
the rank's own local norm, an optimizer stepped on some ranks only, a weight edited on one rank) leaves the ranks
computing different models, silently. Each forward therefore sends, in the one small all-gather that already
checks the ranks were given one batch (``batch_agreement``), a 64-bit fingerprint of a few values of every
replicated parameter: no extra collective, a few small ops. Any differing bit is a ``DriftError`` naming the
first parameter that differs and the likely causes.
"""

from __future__ import annotations

import torch

from autotp.errors import DriftError

SAMPLES = 16
"""Values read of each replicated parameter, evenly spaced: a drifted update changes nearly every value, so a few
catch it, and the cost stays independent of the parameter's size."""
MULTIPLIER = 0x9E3779B97F4A7C15 - (1 << 64)
"""The golden-ratio constant as an int64, as ``batch_agreement`` weighs values."""
PREFIX = "replicated parameter "
"""How a fingerprint row is named among the inputs the batch check compares."""


class Fingerprints:
    """The replicated parameters of one rank module (by original name) and where each is sampled."""

    def __init__(self, named: dict[str, torch.Tensor]):
        self.names = tuple(PREFIX + n for n in named)
        self.tensors = list(named.values())
        self.positions = [_positions(t.numel(), t.device) for t in self.tensors]
        self._weights: torch.Tensor | None = None

    def digests(self) -> torch.Tensor | None:
        """One 64-bit digest per parameter of its sampled values' bits (a float64 holds any float dtype's value
        exactly), or None without replicated parameters."""
        if not self.tensors:
            return None
        # One op per parameter (cat promotes mixed float dtypes exactly), then a few over all of them.
        picked = torch.cat([t.detach().reshape(-1).index_select(0, at) for t, at in zip(self.tensors, self.positions)])
        samples = picked.to(torch.float64).reshape(len(self.tensors), SAMPLES)
        return (samples.view(torch.int64) * self.weights(samples.device)).sum(-1)

    def weights(self, device: torch.device) -> torch.Tensor:
        """Distinct weights per sampled position (as ``batch_agreement.fingerprint`` weighs values)."""
        if self._weights is None or self._weights.device != device:
            self._weights = torch.arange(1, SAMPLES + 1, dtype=torch.int64, device=device) * MULTIPLIER
        return self._weights


def _positions(numel: int, device: torch.device) -> torch.Tensor:
    # SAMPLES positions always (repeating those of a smaller tensor), so the samples stack.
    return torch.linspace(0, max(numel - 1, 0), SAMPLES, device=device).round().long()


def drift_error(name: str, ranks: list[int]) -> DriftError:
    """The error for replicated parameter ``name`` (a fingerprint row's name) differing on ``ranks``."""
    param = name[len(PREFIX):]
    return DriftError(f"{param}, which every tensor-parallel rank holds whole, holds different values on ranks {ranks} "
                      "than on the first rank of the group: the ranks no longer hold one model. Likely causes: "
                      "gradients clipped by each rank's own norm (clip with torch.nn.utils.clip_grad_norm_ on "
                      "pm.parameters() themselves, whose DTensor gradients give the global norm, or with "
                      "pm.clip_grad_norm_), an optimizer stepped or zeroed on some ranks only, or a weight changed on "
                      "one rank; every rank must run the same training step. Reload the last checkpoint (pm.load) "
                      "to continue")


def is_fingerprint(name: str) -> bool:
    """Whether ``name`` names a replicated parameter's fingerprint row (not a model input)."""
    return name.startswith(PREFIX)
