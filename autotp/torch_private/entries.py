"""The fence's table: every private torch API autotp relies on, what it relies on, and the releases checked.

Each fenced function or constant registers one ``Entry`` where it is defined (``fenced``), so the table cannot
leave one out; ``autotp.torch_private.ENTRIES`` lists them, and ``table()`` prints them for the docs.
"""

from __future__ import annotations

from dataclasses import dataclass

from autotp.torch_version import TESTED_TORCH

EVERY_RELEASE = TESTED_TORCH
"""Every tested release: entries reached by every capture, whose tests (capture, checker, generation, MoE) CI runs
on each release of ``TESTED_TORCH`` (``.ci/run``)."""

FIRST_RELEASES = TESTED_TORCH[:2]
"""2.13.0 and 2.14.1: entries whose own tests ran on both but are outside the tests CI runs on later releases."""

FIRST_RELEASE = TESTED_TORCH[:1]
"""2.13.0 only: entries reached by the whole suite, which CI runs on the first release alone."""


@dataclass(frozen=True)
class Entry:
    """One private torch API: the autotp name that uses it, what of torch it relies on, and how it is used
    (``read``: looked up; ``replaces``: a process-wide replacement, put back after, under ``CAPTURE_LOCK``)."""

    name: str
    relies_on: str
    checked: tuple[str, ...]
    replaces: bool = False


ENTRIES: list[Entry] = []
"""Every fenced entry, in the order their modules define them."""


def fenced(relies_on: str, checked: tuple[str, ...] = EVERY_RELEASE, *, replaces: bool = False):
    """Register the decorated function in ``ENTRIES`` (``relies_on``: the private torch API it reads or
    replaces; ``checked``: the torch releases it was checked on); the function itself is returned unchanged."""
    def register(function):
        ENTRIES.append(Entry(function.__name__, relies_on, tuple(checked), replaces))
        return function
    return register


def constant(name: str, relies_on: str, checked: tuple[str, ...] = EVERY_RELEASE) -> None:
    """Register a fenced constant (a name or list of names of torch's private objects) in ``ENTRIES``."""
    ENTRIES.append(Entry(name, relies_on, tuple(checked)))


def table() -> str:
    """``ENTRIES`` as a Markdown table: entry, kind, what it relies on, releases checked."""
    rows = ["| entry | kind | relies on | checked on |", "|---|---|---|---|"]
    for e in ENTRIES:
        kind = "replaces (locked)" if e.replaces else "reads"
        rows.append(f"| `{e.name}` | {kind} | {e.relies_on} | {', '.join(e.checked)} |")
    return "\n".join(rows)
