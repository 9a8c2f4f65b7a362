"""The package's layers, enforced on its imports: passes → planning → rewrite → runtime, tools on top.

Each module may import autotp modules of its own layer or earlier ones only; the passes import only
passes (and third-party libraries); the tools read plans and captured graphs through the public API,
never the rewriter's or the runtime's internals.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

LAYERS = [
    ("foundation", ("autotp.errors", "autotp.options", "autotp.mixed_precision", "autotp.names",
                    "autotp.torch_version")),
    ("passes", ("autotp.passes",)),
    ("capture", ("autotp.capture",)),
    ("planning", ("autotp.planning",)),
    ("rewrite", ("autotp.rewrite",)),
    ("runtime", ("autotp.runtime",)),
    ("api", ("autotp.api", "autotp.checker", "autotp.plan_choice", "autotp")),
    ("tools", ("autotp.tools", "autotp.__main__")),
]
"""Layers from the bottom up; a module's layer is the one whose longest prefix names it."""

TOOLS_MAY_NOT = ("autotp.rewrite", "autotp.runtime")


def _module_files() -> dict[str, Path]:
    """Dotted name -> file for every module of the installed layout (``passes/`` is ``autotp.passes``)."""
    out = {}
    for folder, package in ((ROOT / "autotp", "autotp"), (ROOT / "passes", "autotp.passes")):
        for path in folder.rglob("*.py"):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join([package, *parts])] = path
    return out


def _layer(module: str) -> int:
    best, level = -1, None
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best:
                best, level = len(prefix), index
    assert level is not None, f"{module} belongs to no layer: add it to LAYERS"
    return level


def _imports(path: Path) -> set[str]:
    """Every autotp module ``path`` imports, at any depth (function-level imports included)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            found.update(n for n in names if n.split(".")[0] == "autotp")
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "autotp")
    return found


def _known(name: str, modules: dict[str, Path]) -> str | None:
    """The module ``name`` refers to (``from autotp.planning import Plan`` names a class, not a module)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def test_every_import_points_down_the_layers():
    modules = _module_files()
    wrong = []
    for module, path in modules.items():
        for imported in _imports(path):
            target = _known(imported, modules)
            if target is None or target == module:
                continue
            if _layer(target) > _layer(module):
                wrong.append(f"{module} imports {target} ({LAYERS[_layer(target)][0]} is above "
                             f"{LAYERS[_layer(module)][0]})")
    assert not wrong, "\n".join(wrong)


def test_passes_import_only_passes():
    modules = _module_files()
    wrong = [f"{m} imports {t}" for m, path in modules.items() if m.startswith("autotp.passes")
             for t in map(lambda i: _known(i, modules), _imports(path)) if t and not t.startswith("autotp.passes")]
    assert not wrong, "\n".join(wrong)


def test_tools_stay_out_of_rewrite_and_runtime():
    modules = _module_files()
    wrong = [f"{m} imports {t}" for m, path in modules.items() if _layer(m) == len(LAYERS) - 1
             for t in map(lambda i: _known(i, modules), _imports(path)) if t and t.startswith(TOOLS_MAY_NOT)]
    assert not wrong, "\n".join(wrong)


def test_the_checker_sees_a_back_edge(tmp_path):
    """The check itself can fail: a passes module importing the planner is reported."""
    bad = tmp_path / "bad.py"
    bad.write_text("from autotp.planning.planner import make_plan\nimport autotp.runtime\n", encoding="utf-8")
    assert _imports(bad) == {"autotp.planning.planner", "autotp.planning.planner.make_plan", "autotp.runtime"}
    assert _layer("autotp.planning.planner") > _layer("autotp.passes.rules")
    assert _layer("autotp.tools.viz.model") == len(LAYERS) - 1


RUNTIME_MAY_USE_FROM_REWRITE = ("autotp.rewrite.comm", "autotp.rewrite.streams", "autotp.rewrite.collectives",
                                "autotp.rewrite.vocab_parallel", "autotp.rewrite.data_writes", "autotp.rewrite.dtypes")
"""The rewrite objects a running module holds: its communicators (and the collectives its outputs and loss run
through, the vocab-parallel cross-entropy among them), its random stream, the writes its forward makes to its
weights (made again on FSDP's stored shards), and its graphs' dtypes (``pm.to(dtype)`` retypes their constants, and
a graph built on first use casts its parameters as the policy says). Everything else the runtime needs of a rank's
tensors (placements, parts, weight sources) lives in ``autotp.passes.placement``."""


def test_the_rewriter_reads_plans_not_the_planner():
    modules = _module_files()
    wrong = [f"{m} imports {t}" for m, path in modules.items() if m.startswith("autotp.rewrite")
             for t in map(lambda i: _known(i, modules), _imports(path)) if t == "autotp.planning.planner"]
    assert not wrong, "\n".join(wrong)


def test_runtime_takes_only_communication_and_random_streams_from_the_rewrite():
    modules = _module_files()
    wrong = [f"{m} imports {t}" for m, path in modules.items() if m.startswith("autotp.runtime")
             for t in map(lambda i: _known(i, modules), _imports(path))
             if t and t.startswith("autotp.rewrite") and t not in RUNTIME_MAY_USE_FROM_REWRITE]
    assert not wrong, "\n".join(wrong)


def test_no_module_name_is_used_twice():
    """A file name says one thing: no two modules of the package share their last name (``sources.py`` once meant
    three things in three layers)."""
    modules = _module_files()
    last: dict[str, list[str]] = {}
    for name, path in modules.items():
        if path.name != "__init__.py":
            last.setdefault(path.stem, []).append(name)
    twice = {stem: names for stem, names in last.items() if len(names) > 1}
    assert not twice, twice
