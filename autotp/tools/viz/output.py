"""Write a matplotlib figure as SVG (text kept as text, tooltips added), PNG or a self-contained HTML page.

Only matplotlib's object API is used (no pyplot), so drawing changes no global state.
"""

from __future__ import annotations

import html
import io
import re
from enum import Enum
from pathlib import Path

from autotp.errors import InputError


class PictureFormat(str, Enum):
    """The files ``autotp viz`` writes."""

    SVG = "svg"
    PNG = "png"
    HTML = "html"
    """An HTML page with the SVG inline and the plan's table under it."""
    DOT = "dot"
    """Graphviz source (graphs only), for ``dot -Tpdf``."""


def format_for(path: str, given: str | None = None) -> PictureFormat:
    """The format named by ``given``, else by ``path``'s suffix; ``InputError`` says how to fix either."""
    choice = given or Path(path).suffix.lstrip(".").lower()
    choice = "html" if choice == "htm" else choice
    try:
        return PictureFormat(choice)
    except ValueError:
        names = ", ".join(f.value for f in PictureFormat)
        what = f"format {given!r}" if given else f"the picture format from the file name {path!r}"
        raise InputError(f"cannot use {what}: write to a file ending in one of {names} (or pass --format)") from None


def matplotlib():
    """The matplotlib module, or an ``InputError`` with the install hint (it is a dependency of autotp)."""
    try:
        import matplotlib as mpl
        from matplotlib.figure import Figure  # noqa: F401  (fails early on a broken install)
    except ImportError as e:
        raise InputError("drawing SVG/PNG/HTML needs matplotlib: pip install matplotlib "
                         "(or write a .dot file, which needs nothing)") from e
    return mpl


def _with_tooltips(svg: str, tooltips: dict[str, str]) -> str:
    """Add an SVG <title> (shown on hover) to each group matplotlib wrote with one of our ids."""
    def add(match: re.Match) -> str:
        text = tooltips.get(match.group(1))
        return match.group(0) + (f"\n   <title>{html.escape(text)}</title>" if text else "")
    return re.sub(r'<g id="([^"]+)">', add, svg)


def svg_text(fig, tooltips: dict[str, str] | None = None) -> str:
    """The figure as SVG, with its text as <text> elements (searchable, selectable) and tooltips."""
    mpl = matplotlib()
    buf = io.StringIO()
    with mpl.rc_context({"svg.fonttype": "none", "svg.hashsalt": "autotp"}):
        fig.savefig(buf, format="svg", metadata={"Date": None})  # no timestamp: same plan, same file
    return _with_tooltips(buf.getvalue(), tooltips or {})


def html_page(title: str, svg: str, text: str = "") -> str:
    """A standalone HTML page: the SVG inline, then ``text`` (the plan's table) as preformatted text."""
    body = re.sub(r"^.*?(?=<svg)", "", svg, flags=re.S)  # drop the XML prolog and doctype
    table = f"<pre>{html.escape(text)}</pre>" if text else ""
    return ("<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\">"
            f"<title>{html.escape(title)}</title>"
            "<style>body{font-family:sans-serif;margin:1.5em} svg{max-width:100%;height:auto}"
            "pre{font-size:12px;background:#f6f6f6;padding:1em;overflow-x:auto}</style></head>\n"
            f"<body><h1>{html.escape(title)}</h1>\n{body}\n{table}\n</body></html>\n")


def save(fig, path: str, fmt: PictureFormat, title: str, tooltips: dict[str, str] | None = None,
         text: str = "", dpi: int = 130) -> None:
    """Write ``fig`` to ``path`` as ``fmt`` (SVG, PNG or HTML)."""
    if fmt is PictureFormat.PNG:
        fig.savefig(path, format="png", dpi=dpi)
        return
    svg = svg_text(fig, tooltips)
    out = html_page(title, svg, text) if fmt is PictureFormat.HTML else svg
    Path(path).write_text(out, encoding="utf-8")
