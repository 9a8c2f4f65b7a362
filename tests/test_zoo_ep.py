"""``autotp zoo --ep N``'s pure parts (``devtools.zoo_ep``): which entries it sweeps, and its section of the
coverage page, replaced in place between its markers (the sweep itself runs ``autotp.check``, as the zoo does)."""

from __future__ import annotations

from types import SimpleNamespace

from devtools.zoo_ep import BEGIN, END, ep_section, is_moe, with_section


def test_the_sweep_takes_the_types_whose_config_counts_experts():
    assert is_moe(SimpleNamespace(name="mixtral")) and is_moe(SimpleNamespace(name="qwen3_moe"))
    assert not is_moe(SimpleNamespace(name="llama")) and not is_moe(SimpleNamespace(name="no_such_type"))


def test_the_section_lists_each_verdict_and_replaces_the_last_one():
    first = ep_section({"mixtral": ("exact, expert-split", "2 layers of 4 experts, top-2")}, 2)
    assert "| mixtral | exact, expert-split | 2 layers of 4 experts, top-2 |" in first
    page = with_section("# Coverage\n\nthe table\n", first)
    assert page.startswith("# Coverage\n\nthe table\n") and page.count(BEGIN) == 1
    again = with_section(page + "after\n", ep_section({"gpt_oss": ("exact, kept under tp", "a | b")}, 2))
    assert "mixtral" not in again and "| gpt_oss | exact, kept under tp | a / b |" in again
    assert again.count(BEGIN) == again.count(END) == 1 and again.endswith("after\n")
