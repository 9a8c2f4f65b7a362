"""A rank's random stream: the state its random ops draw from, seeded alike on every rank.

The rank graphs' random modules (``rewrite.random_draws``) draw from it; the runtime restarts it
(``pm.manual_seed``). It is the one rewrite object the runtime holds besides the communicators.
"""

from __future__ import annotations

import contextlib
import threading

import torch


def _default_generator(device: torch.device) -> torch.Generator:
    if device.type == "cuda":
        return torch.cuda.default_generators[device.index if device.index is not None else torch.cuda.current_device()]
    return torch.default_generator


class RankStream:
    """The random stream of one rank's modules: the same seed on every rank of a model."""

    _swap = threading.Lock()
    """The default generators are process-wide: one swap at a time (the checker runs ranks as threads)."""

    def __init__(self, seed: int):
        self.manual_seed(seed)

    def manual_seed(self, seed: int) -> None:
        """Restart the stream at ``seed`` (what ``torch.manual_seed(seed)`` does to a single process)."""
        self.seed = int(seed)
        self._states: dict[str, torch.Tensor] = {}

    def snapshot(self) -> tuple:
        """Where the stream is now (for ``replaying``)."""
        return self.seed, dict(self._states)

    @contextlib.contextmanager
    def replaying(self, snapshot: tuple):
        """Within, draw from ``snapshot``; afterwards the stream is back where it was. A block recomputed in
        backward draws its first forward's masks this way, while the stream goes on for the next forward."""
        here = self.seed, self._states
        self.seed, states = snapshot
        self._states = dict(states)
        try:
            yield
        finally:
            self.seed, self._states = here

    @contextlib.contextmanager
    def drawing(self, device: torch.device):
        """Run the body with torch's generator for ``device`` in this stream's state, then put it back."""
        generator = _default_generator(device)
        with self._swap:
            saved = generator.get_state()
            state = self._states.get(str(device))
            if state is None:
                generator.manual_seed(self.seed)
            else:
                generator.set_state(state)
            try:
                yield
            finally:
                self._states[str(device)] = generator.get_state()
                generator.set_state(saved)
