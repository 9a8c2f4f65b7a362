"""One zoo entry's verdict at one tp: what the sweep (``devtools.zoo``) finds and the table (``devtools.zoo_table``)
reads, kept apart from both so that neither imports the other."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum


class Status(str, Enum):
    """The verdict of one entry at one tp."""

    EXACT = "exact"
    """Exact, and every sizeable matrix the forward uses is split."""
    PARTIAL = "partial"
    """Exact, something sizeable kept whole (the notes say what and why)."""
    REFUSED = "refused"
    """A clear autotp error (capture or plan), not a wrong answer."""
    NOT_BUILDABLE = "not buildable"
    """The tiny config or its model cannot be built."""
    TIMEOUT = "timeout"
    """Did not finish within the sweep's time limit per entry (slow planning, not a wrong answer)."""
    MISMATCH = "MISMATCH"
    """The checker found a difference: a bug in autotp."""
    CRASH = "CRASH"
    """Something raised that is not an autotp error: a bug in autotp."""
    PENDING = "pending"
    """Not swept yet: the table was written from a sweep that stopped early."""


@dataclass
class Result:
    """One entry at one tp."""

    status: Status
    split: float | None = None
    """Fraction of the parameters the forward uses that are split."""
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0
