"""A one-line progress bar on stderr while a checkpoint loads (the first rank only; ``quiet`` silences it)."""

from __future__ import annotations

import sys
import time

WIDTH = 30
"""Characters of the bar itself."""
EVERY = 0.2
"""Seconds between redraws: a redraw per tensor would cost more than small tensors take to read."""


class Progress:
    """``label [#########.....] 63% 120/190 tensors, 310/490 MB, 2.1 s``, redrawn in place on ``stream``."""

    def __init__(self, label: str, tensors: int, nbytes: int, show: bool, stream=None):
        self.label, self.tensors, self.nbytes, self.show = label, tensors, max(nbytes, 1), show
        self.stream = stream if stream is not None else sys.stderr
        self.done_tensors = self.done_bytes = 0
        self.start = self.drawn = time.perf_counter()

    def advance(self, nbytes: int, tensors: int = 1) -> None:
        """Count ``tensors`` more tensors and ``nbytes`` more bytes read."""
        self.done_tensors += tensors
        self.done_bytes += nbytes
        if self.show and time.perf_counter() - self.drawn >= EVERY:
            self._draw(end="")

    def close(self) -> None:
        """Draw the final state and end the line."""
        if self.show:
            self._draw(end="\n")

    def _draw(self, end: str) -> None:
        self.drawn = time.perf_counter()
        fraction = min(self.done_bytes / self.nbytes, 1.0)
        filled = int(fraction * WIDTH)
        line = (f"\r{self.label} [{'#' * filled}{'.' * (WIDTH - filled)}] {fraction:4.0%} "
                f"{min(self.done_tensors, self.tensors)}/{self.tensors} tensors, "
                f"{self.done_bytes / 2**20:.0f}/{self.nbytes / 2**20:.0f} MB, {self.drawn - self.start:.1f} s")
        self.stream.write(line + end)
        self.stream.flush()
