"""The documentation stays true to the code: the options page is the one its generator writes, the
troubleshooting page explains every error class, and every page under docs/ is in the site's navigation."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

import autotp.errors
from autotp.tools import options_doc

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"


def test_the_options_page_is_generated_from_the_field_docstrings():
    page = (DOCS / "options.md").read_text(encoding="utf-8")
    assert page == options_doc.render(), "docs/options.md is stale: python -m autotp.tools.options_doc > docs/options.md"
    assert "| `tp` |" in page and "Tensor-parallel ranks." in page


def test_a_field_without_a_docstring_is_refused():
    from dataclasses import dataclass

    @dataclass
    class Settings:
        documented: int = 1
        """Says what it is."""
        bare: int = 2

    assert options_doc.attribute_docs(Settings) == {"documented": "Says what it is."}
    with pytest.raises(ValueError, match="bare"):
        options_doc._fields_table(Settings)


def test_troubleshooting_explains_every_error_class():
    page = (DOCS / "troubleshooting.md").read_text(encoding="utf-8")
    classes = [name for name, value in vars(autotp.errors).items()
               if inspect.isclass(value) and issubclass(value, (autotp.errors.AutotpError, Warning))
               and value.__module__ == "autotp.errors"]
    assert "AutotpError" in classes and "InternalError" in classes
    missing = [name for name in classes if f"## `{name}`" not in page]
    assert not missing, f"docs/troubleshooting.md has no section for {missing}"


def test_every_page_is_in_the_site_navigation():
    nav = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    listed = set(re.findall(r":\s*([\w./-]+\.md)\s*$", nav, flags=re.M))
    pages = {p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md")}
    assert pages <= listed, f"pages missing from mkdocs.yml's nav: {sorted(pages - listed)}"
    assert listed <= pages, f"nav entries with no page: {sorted(listed - pages)}"


def test_the_readme_links_to_files_that_exist():
    """The README is read on GitHub, outside the site's strict build: its relative links are checked here."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    targets = [t.split("#")[0] for t in re.findall(r"\]\(([^)\s]+)\)", readme) if "://" not in t]
    assert targets, "the README links to no page"
    missing = [t for t in targets if not (ROOT / t).exists()]
    assert not missing, f"README links to missing files: {missing}"
