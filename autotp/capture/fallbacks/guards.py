"""Capture fallbacks for data-dependent branches in a model's own Python.

Some forwards decide a branch on tensor values: a validation (``if labels.max() >= vocab_size: raise``), a
mask inspected to see whether it is causal (``nn.Transformer``), chunk sizes read from a tensor. torch.export
cannot trace such a branch symbolically. Where plain capture fails, ``export_taking_example_branches`` captures
again with ``torch.export.draft_export``, which decides each such branch by the example's real values and
keeps the decision in the graph as a runtime assertion (``aten._assert_scalar``): the parallel module takes the
same branch, and raises if an input would take another.

A branch decided by random numbers (LayerDrop's ``torch.rand([]) < layerdrop``) or by the host's random
generators (SpecAugment's numpy masks) is different: the example's draw would be frozen into every step. Such
captures are refused, with the setting that switches the randomness off, read from the model's own source
(the ``if`` around the failing line, or the line itself, names ``config.<setting>``).
"""

from __future__ import annotations

import ast
import contextlib
import linecache
import os
import random
import re
import traceback
from functools import lru_cache

import torch
from torch import fx

from autotp.capture.fallbacks.fake_kernels import fake_kernels_registered
from autotp.torch_private import decompositions_off, expression_tracing_off
from autotp.errors import CaptureError, TrainingSettingError

aten = torch.ops.aten

RANDOM_OPS = frozenset(getattr(aten, name) for name in (
    "rand", "rand_like", "randn", "randn_like", "randint", "randint_like", "randperm", "bernoulli", "uniform",
    "normal", "multinomial", "exponential", "geometric", "log_normal", "cauchy") if hasattr(aten, name))
"""Packets of ops whose values are random draws (each overload is matched by its packet)."""

SCALAR_READS = frozenset({aten.item.default, aten._local_scalar_dense.default})
"""Ops that turn a tensor value into a Python scalar: a branch on their result is data-dependent."""

_SETTING = re.compile(r"config\.(\w+)")


def _packet(node: fx.Node):
    return getattr(node.target, "overloadpacket", None)


def _ancestors(node: fx.Node) -> set[fx.Node]:
    seen, stack = set(), [node]
    while stack:
        for parent in stack.pop().all_input_nodes:
            if parent not in seen:
                seen.add(parent)
                stack.append(parent)
    return seen


def _source_line(node: fx.Node) -> tuple[str, int, str]:
    """The model's source line a node was traced from: (file, line, code)."""
    trace = node.meta.get("stack_trace") or ""
    found = re.findall(r'File "([^"]+)", line (\d+), in \w+\n\s*(.*)', trace)
    if not found:
        return "", 0, ""
    file, line, code = found[-1]
    return file, int(line), code.strip()


def export_taking_example_branches(wrapper: torch.nn.Module, inputs: tuple, dynamic_shapes, config=None):
    """Capture with every data-dependent branch taken as the example takes it, each kept as a runtime assertion
    in the graph. Returns the module and one line per assumption (the model's code and where it is); raises
    ``CaptureError`` where a branch depends on random numbers (``TrainingSettingError`` naming the settings of
    ``config``, the model's config, that switch them off, where the branch's code reads some)."""
    host = _host_rng_states()
    # silencing draft_export's expression tracing is a speed-up, off with the others (``capture(speedups=False)``)
    quiet = expression_tracing_off() if getattr(wrapper, "speedups", True) else contextlib.nullcontext()
    with quiet, decompositions_off(), fake_kernels_registered():
        program = torch.export.draft_export(wrapper, inputs, strict=False, dynamic_shapes=dynamic_shapes)
    if _host_rng_states() != host:
        raise random_refusal("the forward draws from numpy's or Python's random generator, which a captured "
                             "graph cannot replay", [], config)
    other = [f for f in program._report.failures if f.failure_type.name not in ("DATA_DEPENDENT_ERROR", "GUARD_ADDED")]
    if other:
        raise RuntimeError(f"draft export reported {other[0].failure_type.name}")
    gm = program.module()
    assumptions = []
    for node in gm.graph.find_nodes(op="call_function", target=aten._assert_scalar.default):
        inputs_of = _ancestors(node)
        if not any(n.target in SCALAR_READS for n in inputs_of):
            continue  # a check on input sizes, not on values
        file, line, code = _source_line(node)
        if any(_packet(n) in RANDOM_OPS for n in inputs_of) and not _decided_by_any_draw(inputs_of):
            raise random_refusal(f"a branch at {os.path.basename(file)}:{line} (`{code}`) depends on random "
                                 "numbers", [(file, line)], config)
        assumptions.append(f"`{code}` ({os.path.basename(file)}:{line})")
    return gm, tuple(dict.fromkeys(assumptions))


_UNIT_DRAW_TESTS = {
    # op packet -> (always False, always True) for ``u <op> c`` with u drawn from [0, 1), as functions of c
    aten.lt: (lambda c: c <= 0, lambda c: c >= 1), aten.le: (lambda c: c < 0, lambda c: c >= 1),
    aten.gt: (lambda c: c >= 1, lambda c: c < 0), aten.ge: (lambda c: c >= 1, lambda c: c <= 0)}


def _decided_by_any_draw(nodes: set[fx.Node]) -> bool:
    """Whether every random draw among ``nodes`` is a uniform [0, 1) draw (``torch.rand``) read only by comparisons
    with a number whose outcome no draw changes: LayerDrop's ``torch.rand([]) < layerdrop`` with the rate set to 0
    skips no layer whatever it draws, so the branch the example takes is every step's."""
    draws = [n for n in nodes if _packet(n) in RANDOM_OPS]
    for draw in draws:
        if _packet(draw) is not aten.rand:
            return False
        for test in draw.users:
            always = _UNIT_DRAW_TESTS.get(_packet(test))
            limit = test.args[1] if len(test.args) > 1 else None
            if always is None or test.args[0] is not draw or not isinstance(limit, (int, float)) \
                    or not (always[0](limit) or always[1](limit)):
                return False
    return True


def _host_rng_states() -> tuple:
    try:
        import numpy

        state = numpy.random.get_state()[1].tobytes()
    except ImportError:
        state = b""
    return state, random.getstate()


def random_refusal(what: str, places: list[tuple[str, int]], config=None) -> CaptureError:
    """The refusal of a capture whose branch at ``places`` depends on random numbers: a ``TrainingSettingError``
    that names, first, the settings of ``config`` the code there reads, else a ``CaptureError``."""
    settings = _settings_at(places, config)
    if settings:
        return training_setting_error(settings, f"{what}, so every step would repeat the example's draw")
    return CaptureError(f"cannot capture the model in training mode: {what}, so every step would repeat the "
                        "example's draw; make the branch independent of random values, or capture in eval mode")


def training_setting_error(settings: list[str], why: str) -> TrainingSettingError:
    """The refusal naming, in its first words, the config settings to set to 0 (a training-time augmentation or
    layer drop), then why."""
    change = " and ".join(f"{s}=0" for s in settings)
    return TrainingSettingError(f"set {change} in the model's config to capture it in training mode (or capture in "
                                f"eval mode): {why}", dict.fromkeys(settings, 0))


def training_branch_settings(error: BaseException, config=None) -> list[str]:
    """For a capture failure inside a branch the model's own code guards by a config setting and by ``training``
    (``if self.config.mask_time_prob > 0 and self.training:``), the settings of ``config`` it reads; else []."""
    torch_dir = os.path.dirname(torch.__file__)
    places = [(f.filename, f.lineno) for f in traceback.extract_tb(error.__traceback__)
              if not f.filename.startswith((torch_dir, os.path.dirname(os.path.dirname(__file__))))]
    return _settings_at(places, config, only_training=True)


def _settings_at(places: list[tuple[str, int]], config=None, only_training: bool = False) -> list[str]:
    """Config settings read by the innermost ``if`` test (or the line itself) around each place, innermost place
    first; with ``only_training``, only tests that also read ``training``. A setting is read as ``config.<field>``
    or as ``self.<name>`` that the class set from ``config.<field>`` (or that ``config`` has); given ``config``,
    only its fields holding a nonzero number count (the ones that switch something on), named by their path
    from ``config`` when they live on a config nested in it (``encoder.mask_time_prob``)."""
    out: list[str] = []
    for file, line in reversed(places):
        copied = _copied_settings(file, line)
        for test in _enclosing_tests(file, line):
            if only_training and "training" not in test:
                continue
            names = _SETTING.findall(test) + [copied.get(n, n) for n in _SELF.findall(test)]
            found = [_setting_path(config, s, direct=s in _SETTING.findall(test)) for s in names]
            out += [s for s in found if s is not None and s not in out]
        if out:
            break
    return out


_SELF = re.compile(r"\bself\.(\w+)\b(?!\s*\()")


def _switches_on(config, name: str) -> bool:
    """Whether ``name`` is a setting of ``config`` that is switched on (a nonzero number)."""
    value = getattr(config, name, None)
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value != 0


def _sub_configs(config) -> list[tuple[str, object]]:
    """The configs nested in ``config`` (an encoder-decoder's ``encoder``, a CTC head's ``encoder_config``), by
    attribute name: the model's parts are built from them, so a part's code reads its own config's settings."""
    return [(name, value) for name, value in vars(config).items()
            if any(c.__name__.lower() == "pretrainedconfig" for c in type(value).__mro__)]


def _setting_path(config, name: str, direct: bool) -> str | None:
    """Where the switched-on setting ``name`` lives: ``name`` on ``config`` itself, else ``part.name`` on a config
    nested in it (breadth first), else None; without a config, ``name`` when read as ``config.<name>``."""
    if config is None:
        return name if direct else None
    level = [("", config)]
    for _ in range(3):
        for prefix, c in level:
            if _switches_on(c, name):
                return prefix + name
        level = [(f"{prefix}{n}.", sub) for prefix, c in level for n, sub in _sub_configs(c)]
    return None


def _copied_settings(file: str, line: int) -> dict[str, str]:
    """``{name: field}`` for each ``self.<name> = config.<field>`` in the class that holds ``line``."""
    tree = _parsed(file)
    if tree is None:
        return {}
    classes = [c for c in ast.walk(tree) if isinstance(c, ast.ClassDef) and c.lineno <= line <= (c.end_lineno or 0)]
    if not classes:
        return {}
    out = {}
    for node in ast.walk(max(classes, key=lambda c: c.lineno)):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Attribute) \
                and isinstance(node.value.value, ast.Name) and node.value.value.id == "config":
            for target in node.targets:
                if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == "self":
                    out[target.attr] = node.value.attr
    return out


def _enclosing_tests(file: str, line: int) -> list[str]:
    """The source of the line itself, of the assignments in its function to the names it reads (``skip =
    self.training and rand < self.config.layerdrop`` for ``if not skip:``), and of each ``if``/conditional test
    whose body holds ``line``, innermost first."""
    tree = _parsed(file)
    code = linecache.getline(file, line).strip()
    if tree is None:
        return [code]
    source = _source(file)
    tests, function = [], None
    for node in ast.walk(tree):
        spans = node.lineno <= line <= (node.end_lineno or node.lineno) if hasattr(node, "lineno") else False
        if isinstance(node, (ast.If, ast.IfExp)) and spans:
            tests.append((node.lineno, ast.get_source_segment(source, node.test) or ""))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and spans:
            function = node if function is None or node.lineno > function.lineno else function
    read = set(re.findall(r"\b\w+\b", code))
    feeding = [ast.get_source_segment(source, a) or "" for a in ast.walk(function or tree)
               if isinstance(a, ast.Assign) and a.lineno < line
               and any(isinstance(t, ast.Name) and t.id in read for t in a.targets)] if function else []
    return [code] + feeding + [t for _, t in sorted(tests, reverse=True)]


@lru_cache(maxsize=64)
def _source(file: str) -> str:
    try:
        with open(file, encoding="utf-8") as f:
            return f.read()
    except OSError:
        return ""


@lru_cache(maxsize=64)
def _parsed(file: str):
    try:
        return ast.parse(_source(file))
    except SyntaxError:
        return None
