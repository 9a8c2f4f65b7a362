"""The private-torch fence (``autotp.torch_private``): no private torch API outside it, nothing private read at
import, every entry in its table, and every process-wide replacement put back and held under the capture lock."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import torch

from autotp import torch_private
from autotp.torch_private.entries import ENTRIES, table

ROOT = Path(__file__).resolve().parent.parent

PRIVATE = re.compile(r"\btorch(?:\.[A-Za-z]\w*)*\._(?!_)|^\s*from torch(?:\.\w+)* import [^#\n]*\b_[A-Za-z]", re.M)
"""A private torch name: ``torch._C``, ``torch.fx._lazy_graph_module``, ``from torch import _prims_common``
(``torch.__version__`` and other dunders are public)."""

OPS = re.compile(r"\btorch\.ops\.[\w.]*")
"""``torch.ops.aten._to_copy``: an op of the graphs (its name begins with ``_``), not a private Python API."""


def _library_files() -> list[Path]:
    return [p for folder in (ROOT / "autotp", ROOT / "passes") for p in folder.rglob("*.py")
            if "torch_private" not in p.relative_to(ROOT).parts]


def private_uses(text: str) -> list[str]:
    """The private torch names ``text`` uses (op names excepted)."""
    return PRIVATE.findall(OPS.sub("", text))


def test_no_private_torch_outside_the_fence():
    found = [f"{p.relative_to(ROOT)}: {use}" for p in _library_files()
             for use in private_uses(p.read_text(encoding="utf-8"))]
    assert not found, "private torch APIs belong in autotp/torch_private/:\n" + "\n".join(found)


def test_the_grep_sees_private_names():
    """The check itself can fail: each private form is found, public ones and op names are not."""
    assert private_uses("x = torch._C._set_grad_enabled") == ["torch._"]
    assert private_uses("from torch.fx._lazy_graph_module import f") != []
    assert private_uses("from torch.fx.experimental import _config") != []
    assert private_uses("torch.__version__, torch.fx.Graph, torch.ops.aten._to_copy.default") == []


class _NoStrings(ast.NodeTransformer):
    def visit_Constant(self, node):
        return ast.Constant("") if isinstance(node.value, str) else node


def import_time_code(text: str) -> str:
    """The code of ``text`` that runs when its module is imported: every statement but function and class bodies
    (their decorators run), strings blanked (an entry's ``relies_on`` names private APIs without reading them)."""
    tree = _NoStrings().visit(ast.parse(text))
    parts = []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            parts.extend(ast.unparse(d) for d in node.decorator_list)
        else:
            parts.append(ast.unparse(node))
    return "\n".join(parts)


def test_nothing_private_is_read_at_import():
    """The fence reads torch's private objects when an entry is used, never when it is imported (a torch release
    without one then fails only the capture that needs it, with the entry's ``InternalError``)."""
    fence = sorted((ROOT / "autotp" / "torch_private").glob("*.py"))
    found = [f"{p.name}: {use}" for p in fence for use in private_uses(import_time_code(p.read_text(encoding="utf-8")))]
    assert not found, found
    assert private_uses(import_time_code("import torch\nX = torch._C.TensorBase.data\n")) == ["torch._"]
    assert private_uses(import_time_code("def f():\n    return torch._C.TensorBase.data\n")) == []


def test_every_entry_says_what_it_relies_on_and_where_it_was_checked():
    names = [e.name for e in ENTRIES]
    assert len(names) == len(set(names)), "an entry is registered twice"
    for entry in ENTRIES:
        assert entry.relies_on and entry.checked, entry
        assert set(entry.checked) <= set(torch_private.entries.EVERY_RELEASE), entry
    replaced = {e.name for e in ENTRIES if e.replaces}
    assert {"applied_functions", "unchanged_module_casts", "composite_kernels_replaced", "no_cycle_collection",
            "quiet_torch_logs", "no_stack_traces", "no_symbolic_layout_probes", "lazy_recompiles"} <= replaced
    assert all(f"`{name}`" in table() for name in names)


def test_replacements_are_put_back_and_hold_the_lock():
    """Each replacement leaves torch as it found it, and holds the capture lock while in place."""
    import gc
    import logging

    import torch.fx.config as fx_config

    before = (torch.autograd.Function.__dict__["apply"], torch.nn.Module.to, gc.isenabled(),
              fx_config.do_not_emit_stack_traces, logging.getLogger("torch").level, torch.Tensor.__dict__.get("nonzero"))
    for replacement in (lambda: torch_private.applied_functions(set()), torch_private.unchanged_module_casts,
                        torch_private.no_cycle_collection, torch_private.no_stack_traces,
                        torch_private.quiet_torch_logs, torch_private.no_symbolic_layout_probes,
                        torch_private.lazy_recompiles, torch_private.distribution_checks_off,
                        lambda: torch_private.methods_replaced({(torch.Tensor, "nonzero"): lambda self: None})):
        with replacement():
            assert torch_private.CAPTURE_LOCK._is_owned()
    after = (torch.autograd.Function.__dict__["apply"], torch.nn.Module.to, gc.isenabled(),
             fx_config.do_not_emit_stack_traces, logging.getLogger("torch").level, torch.Tensor.__dict__.get("nonzero"))
    assert after == before
    assert not torch_private.CAPTURE_LOCK._is_owned()


@pytest.mark.parametrize("name", ["size_expr", "output_spec", "symbolic_expr"])
def test_a_changed_torch_is_an_internal_error(name):
    """An entry whose torch object is gone raises ``InternalError`` naming the torch version."""
    from autotp.errors import InternalError

    with pytest.raises(InternalError, match=re.escape(torch.__version__)):
        getattr(torch_private, name)(object()) if name != "output_spec" else \
            torch_private.output_spec(torch.fx.GraphModule(torch.nn.Module(), torch.fx.Graph()))


def test_the_docs_table_is_the_fence_s_own():
    """docs/capture.md carries ``table()``'s output between its markers: regenerate it when an entry changes."""
    page = (ROOT / "docs" / "capture.md").read_text(encoding="utf-8")
    start = page.index("-->\n", page.index("<!-- fence table")) + len("-->\n")
    assert page[start:page.index("<!-- end of fence table -->")].strip() == table()
