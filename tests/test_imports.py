"""The package's layers, enforced on its imports: passes → capture → planning → rewrite → runtime, tools on top.

Each module may import autotp modules of its own layer or earlier ones only; the passes import only
passes, the private-torch fence (``autotp.torch_private``) and third-party libraries; the capture's subpackages
are layered by job; the tools read plans and captured graphs through the public API, never the rewriter's or the
runtime's internals. The capture and the fence import in no cycle.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

LAYERS = [
    ("foundation", ("autotp.errors", "autotp.options", "autotp.mixed_precision", "autotp.names",
                    "autotp.torch_version", "autotp.torch_private")),
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


PASSES_MAY_USE = ("autotp.passes", "autotp.torch_private", "autotp.torch_version", "autotp.errors")
"""What the passes may import: themselves and the fence (with what the fence itself imports)."""


def test_passes_import_only_passes():
    modules = _module_files()
    wrong = [f"{m} imports {t}" for m, path in modules.items() if m.startswith("autotp.passes")
             for t in map(lambda i: _known(i, modules), _imports(path)) if t and not t.startswith(PASSES_MAY_USE)]
    assert not wrong, "\n".join(wrong)


CAPTURE_JOBS = ("autotp.capture.quirks", "autotp.capture.speedups", "autotp.capture.fallbacks", "autotp.capture.core",
                "autotp.capture.stamping")
"""The capture's subpackages from the bottom up: model-quirk normalisation, speed-ups, fallbacks for hard models,
the core (export, the captured value, example inputs, dynamic sizes, failures), block stamping. Each may import
its own job and earlier ones (and ``autotp.capture`` itself, the package, only from outside)."""


def _job(module: str) -> int | None:
    return next((i for i, job in enumerate(CAPTURE_JOBS) if module == job or module.startswith(job + ".")), None)


def test_every_capture_module_belongs_to_a_job():
    """A module added to ``autotp/capture/`` goes into a subpackage of one job, never beside them."""
    loose = [m for m in _module_files() if m.startswith("autotp.capture.") and _job(m) is None]
    assert not loose, f"{loose}: move each into one of {CAPTURE_JOBS}"


def test_capture_jobs_import_down_their_order():
    modules = _module_files()
    wrong = []
    for module, path in modules.items():
        job = _job(module)
        if job is None:
            continue
        for target in filter(None, (_known(i, modules) for i in _imports(path))):
            if target == "autotp.capture" or (target.startswith("autotp.capture.") and _job(target) > job):
                wrong.append(f"{module} imports {target}")
    assert not wrong, "\n".join(wrong)


def _cycles(prefixes: tuple[str, ...]) -> list[list[str]]:
    """The import cycles (strongly connected groups of two or more modules, function-level imports included) among
    the modules named by ``prefixes``."""
    modules = _module_files()
    inside = [m for m in modules if m.startswith(prefixes)]
    return _cycles_in({m: {t for t in (_known(i, modules) for i in _imports(modules[m])) if t in inside and t != m}
                       for m in inside})


def _cycles_in(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of two or more nodes of ``graph`` (node -> the nodes it points to)."""
    reach = {m: _reachable(graph, m) for m in graph}
    groups = {frozenset([m, *(o for o in reach[m] if m in reach[o])]) for m in graph}
    return sorted(sorted(g) for g in groups if len(g) > 1)


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, frontier = set(), [start]
    while frontier:
        for nxt in graph[frontier.pop()]:
            if nxt not in seen:
                seen.add(nxt)
                frontier.append(nxt)
    return seen


def test_the_capture_and_the_fence_import_in_no_cycle():
    assert _cycles(("autotp.capture", "autotp.torch_private")) == []


def test_the_cycle_finder_finds_one():
    """The cycle check itself can fail: two modules importing each other are one cycle, one importing them is not
    in it, and a chain is none."""
    assert _cycles_in({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]
    assert _cycles_in({"a": {"b"}, "b": {"c"}, "c": set()}) == []


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
                                "autotp.rewrite.dtypes", "autotp.rewrite.grad_bucket")
"""The rewrite objects a running module holds: its communicators (and the collectives its outputs and loss run
through, the vocab-parallel cross-entropy among them; the end-of-backward bucket of gradient shares, which a
pipeline's step holds until its schedule ends), its random stream, and its graphs' dtypes (``pm.to(dtype)``
retypes their constants, and a graph built on first use casts its parameters as the policy says). Everything else
the runtime needs of a rank's tensors (placements, parts, weight sources) lives in ``autotp.passes.placement``, and
the writes a forward makes to its weights (made again on FSDP's stored shards) are found with
``autotp.passes.parameter_data``."""


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


def test_every_package_is_installed():
    """pyproject.toml lists its packages one by one: a subpackage left out works in this editable checkout and is
    missing from an installed wheel."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]["packages"])
    found = {name for name, path in _module_files().items() if path.name == "__init__.py"}
    assert found == listed, f"listed but absent: {sorted(listed - found)}; absent from the list: {sorted(found - listed)}"


REPOSITORY_PACKAGES = ("devtools", "bench")
"""Packages of the repository that are not installed (the zoo and the tiny-config builder; the benchmarks)."""


def _repository_files() -> dict[str, Path]:
    """``_module_files`` and the repository's own packages' modules (dotted name -> file)."""
    out = _module_files()
    for package in REPOSITORY_PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _runtime_imports(path: Path, modules: dict[str, Path]) -> set[str]:
    """The modules ``path`` imports when it runs, at any depth (``TYPE_CHECKING`` blocks are never run); ``from
    package import module`` names the module, not the package's ``__init__``."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    unrun = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
             for statement in node.body for n in ast.walk(statement)}
    found = set()
    for node in ast.walk(tree):
        if id(node) in unrun:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.update(f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                         for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return {m for m in (_known(name, modules) for name in found) if m}


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The cycles of ``graph`` (module -> modules it imports): each strongly connected component of more than one
    module, found by Tarjan's algorithm without recursion."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            following = next((t for t in edges if t in graph and (t not in index or t in on_stack)), None)
            if following is not None and following not in index:
                index[following] = low[following] = len(index)
                stack.append(following)
                on_stack.add(following)
                work.append((following, iter(sorted(graph[following]))))
                continue
            if following is not None:  # an edge back into the current component
                low[node] = min(low[node], index[following])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    cycles.append(sorted(component))
    return cycles


def test_no_import_cycles_anywhere():
    """No module of the package, the zoo or the benchmarks imports (even inside a function) one that imports it
    back: each layer's modules can be read and tested from the bottom up."""
    modules = _repository_files()
    graph = {m: _runtime_imports(path, modules) - {m} for m, path in modules.items()}
    assert not import_cycles(graph), "\n".join(" <-> ".join(c) for c in import_cycles(graph))


def test_the_cycle_finder_finds_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert import_cycles(graph) == [["a", "b", "c"]]
    assert import_cycles({"a": {"b"}, "b": set()}) == []


def test_the_library_never_imports_the_repository_tools():
    """``devtools`` and ``bench`` are not installed: the package must run without them."""
    modules = _repository_files()
    wrong = [f"{m} imports {t}" for m, path in modules.items() if m.split(".")[0] == "autotp"
             for t in _runtime_imports(path, modules) if t.split(".")[0] in REPOSITORY_PACKAGES]
    assert not wrong, "\n".join(wrong)
