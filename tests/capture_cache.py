"""Capture each test model once per process: an exact memo of ``autotp.capture.capture`` for the test suite.

torch.export tracing is most of the suite's time (85% of a structure test's rank, profiled): every test and every
rank built the same seeded model and captured it again, and a worker that parallelizes one model several times
(a checkpoint loaded at another tp) captured it each time. A capture depends only on the model's classes, its
modules' settings and modes, its tensors (names, ties, shapes, dtypes, values), the example inputs, the mode
asked for and torch's global modes; all of them are the key here, so a hit is the graph the capture would have
made. Captures read the tensors of the model first captured with that key (its source), so one model's train and
eval graphs keep sharing them; the source must still equal the key (a one-process module copies its weights from
the graph's tensors, and the source's test may have trained it since): else the next model equal to the key
becomes the source and is captured again.

Only the entry points that treat a capture as read-only use it (``parallelize``, ``check``, the loss graph of
``step``, and ``plan``'s stamped capture, kept apart from full ones); inside ``capture_repeated`` the capture of
the shortened model is edited, and ``pm.generate`` edits its cache steps, so both keep calling torch.export
there. A failed capture is never stored: clear-error tests see every attempt.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
import time
from collections import OrderedDict

import torch
from torch import nn

LIMIT = 256
"""Models whose captures are kept (least recently used dropped first): the suite's files share many (the same tiny
model on the same tokens), and a tiny model's captures hold a few MB."""
LARGEST = 20_000_000
"""Elements of the largest model kept (the test models are tiny; a zoo model need not stay in memory)."""
BUDGET = 100_000_000
"""Elements of all kept models together (least recently used dropped first past it): the zoo's larger models."""
_SOURCES: OrderedDict = OrderedDict()
_COUNTS = {"hits": 0, "misses": 0}
_BYPASSED = [False]
_KEPT: dict[int, object] = {}
"""Objects a key names by identity, kept alive so that their ids are never reused."""
_OPEN: set[int] = set()
"""Modules whose key is being made (a module an attribute points back to is then named by identity)."""


def _digest(t: torch.Tensor):
    """A tensor's identity for the key: layout, and its values unless it has none (meta)."""
    head = (tuple(t.shape), t.dtype, t.device.type, t.requires_grad, isinstance(t, nn.Parameter))
    if t.is_meta or t.numel() == 0:
        return head
    data = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    return head + (hashlib.blake2b(data.numpy().tobytes(), digest_size=16).hexdigest(),)


def _value(v):
    """A module attribute (a config, a head count, the loss function a wrapper calls) as part of the key."""
    if v is None or isinstance(v, (bool, int, float, str, torch.dtype, torch.device)):
        return v
    if isinstance(v, torch.Tensor):
        return _digest(v)
    if isinstance(v, nn.Module):
        return _model_key(v) if id(v) not in _OPEN else _identity(v)
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        return (type(v), tuple((f.name, _value(getattr(v, f.name))) for f in dataclasses.fields(v)), _private(v))
    if isinstance(v, (tuple, list)):
        return (type(v).__name__, tuple(_value(x) for x in v))
    if isinstance(v, dict):
        return ("dict", tuple(sorted((repr(k), _value(x)) for k, x in v.items())))
    if isinstance(v, (set, frozenset)):
        return ("set", tuple(sorted(repr(x) for x in v)))
    text = repr(v)  # a config prints its values; an object without a repr of its own, its address
    if callable(v) or "..." in text:  # a function, or a repr that leaves values out: by identity
        return _identity(v)
    return type(v), text, _private(v)


def _private(v) -> tuple:
    """An object's private settings of plain values, which its repr may leave out (a transformers config's
    ``_experts_implementation``: the same config prints alike whether its experts loop or run grouped matmuls)."""
    plain = (type(None), bool, int, float, str)
    return tuple(sorted((k, x) for k, x in getattr(v, "__dict__", {}).items()
                        if k.startswith("_") and isinstance(x, plain)))


def _identity(v) -> tuple:
    _KEPT[id(v)] = v
    return "id", id(v)


def _attrs(m: nn.Module) -> tuple:
    """A module's own settings: every attribute but its registered tensors and children (hooks by count)."""
    out = []
    for k, v in vars(m).items():
        if k in ("_parameters", "_buffers", "_modules"):
            continue
        out.append((k, len(v) if k.endswith("hooks") and isinstance(v, dict) else _value(v)))
    return tuple(sorted(out, key=lambda kv: kv[0]))


def _tensors(m: nn.Module) -> tuple:
    """Every parameter and buffer under each of its names, with the first name it is tied to."""
    first: dict[int, str] = {}
    named = [*m.named_parameters(remove_duplicate=False), *m.named_buffers(remove_duplicate=False)]
    return tuple((name, first.setdefault(id(t), name), _digest(t)) for name, t in named)


def _model_key(model: nn.Module) -> tuple:
    named = list(model.named_modules(remove_duplicate=False))
    opened = {id(m) for _, m in named} - _OPEN
    _OPEN.update(opened)
    try:
        modules = tuple((name, type(m), m.training, _attrs(m)) for name, m in named)
    finally:
        _OPEN.difference_update(opened)
    return type(model), modules, _tensors(model)


def _modes(kind: str) -> tuple:
    """torch's global modes a capture of ``kind`` depends on. A full capture traces with autocast off
    (``autotp.capture.core.export.autocast_off``: the same graph inside the user's ``torch.autocast``), so autocast
    is left out of its key: ranks that parallelize inside autocast find the model captured outside it."""
    if kind == "full":
        return torch.is_grad_enabled(), torch.get_default_dtype()
    return torch.is_grad_enabled(), torch.get_default_dtype(), torch.is_autocast_enabled("cpu")


@dataclasses.dataclass
class _Source:
    """The model a group of captures was made from, and those captures by (example inputs, mode, torch's modes).

    Every capture of a group reads the same tensors, as captures of one model do (a rank module's train and eval
    graphs share the tensors both read); later models equal to the source get its captures."""

    model: nn.Module
    captures: dict = dataclasses.field(default_factory=dict)


def cached(capture, kind: str = "full"):
    """``capture`` with the memo in front (same signature: model, example_inputs, training). ``kind`` names what it
    makes (a full capture; the planner's stamped one, ``capture_repeated``): each kind is kept apart."""

    def cached_capture(model, example_inputs=None, training=None, *, speedups=None):
        if _BYPASSED[0] or not isinstance(model, nn.Module) or sum(t.numel() for t in model.parameters()) > LARGEST:
            return capture(model, example_inputs, training, speedups=speedups)  # the real one says what is wrong
        key, how = _model_key(model), (_value(example_inputs), training, _modes(kind), _speedups(speedups), kind)
        source = _SOURCES.get(key)
        if source is None or (source.model is not model and _model_key(source.model) != key):
            source = _SOURCES[key] = _Source(model)  # none yet, or its model was trained since: start again
            _evict()
        _SOURCES.move_to_end(key)
        if how in source.captures:
            _COUNTS["hits"] += 1
            _log(model, key, how, None)
            return source.captures[how]
        # equal to ``model`` in everything the key holds
        start = time.process_time()
        captured = capture(source.model, example_inputs, training, speedups=speedups)
        _COUNTS["misses"] += 1
        _log(model, key, how, time.process_time() - start)
        source.captures[how] = captured
        return captured

    cached_capture.__wrapped__ = capture
    return cached_capture


def _speedups(setting: bool | None):
    """Whether the capture uses its speed-ups, as it decides (an unset setting reads the environment, which a test may
    change between captures); the setting itself where it is not valid (the real capture then says why)."""
    from autotp.capture.speedups.speedup_switch import speedups_enabled
    from autotp.errors import InputError

    try:
        return speedups_enabled(setting)
    except InputError:
        return ("invalid", setting)


def _elements(model: nn.Module) -> int:
    return sum(t.numel() for t in (*model.parameters(), *model.buffers()))


def _evict() -> None:
    """Drop the least recently used models past LIMIT models or BUDGET elements (the newest is always kept)."""
    while len(_SOURCES) > 1 and (len(_SOURCES) > LIMIT or
                                 sum(_elements(s.model) for s in _SOURCES.values()) > BUDGET):
        _SOURCES.popitem(last=False)


LOG = "AUTOTP_TEST_CAPTURE_LOG"
"""An environment variable naming a file: each capture the memo makes (a miss) appends a line to it (process,
test, model, kind and mode, CPU seconds, key digest), each capture it serves (a hit) the same line with ``hit`` for
the seconds, to find the captures a suite run repeats across tests and ranks, and what the memo saves."""


def _log(model: nn.Module, key, how, seconds: float | None) -> None:
    path = os.environ.get(LOG)
    if not path:
        return
    digest = hashlib.blake2b(repr((key, how)).encode(), digest_size=6).hexdigest()  # ids differ across processes
    test = os.environ.get("PYTEST_CURRENT_TEST", "-").split(" ")[0]
    spent = "hit" if seconds is None else f"{seconds:.2f}"
    with open(path, "a") as f:
        f.write(f"{os.getpid()}\t{test}\t{type(model).__name__}\t{how[-1]}:{how[1]}\t{spent}\t{digest}\n")


def install() -> None:
    """Put the memo in front of the read-only capture entry points (once per process)."""
    import autotp.api
    import autotp.capture.core.with_loss
    import autotp.checker

    for module in (autotp.api, autotp.checker, autotp.capture.core.with_loss):
        if not hasattr(module.capture, "__wrapped__"):
            module.capture = cached(module.capture)
    if not hasattr(autotp.api.capture_repeated, "__wrapped__"):  # ``plan``'s: planning only reads the graph
        autotp.api.capture_repeated = cached(autotp.api.capture_repeated, "stamped")


@contextlib.contextmanager
def bypassed():
    """Every capture inside calls torch.export (for a test that counts what one capture builds)."""
    _BYPASSED[0] = True
    try:
        yield
    finally:
        _BYPASSED[0] = False


def warm(model: nn.Module, example_inputs) -> None:
    """Capture ``model`` on ``example_inputs`` in train and eval mode, as ``parallelize`` does, in this process:
    ranks forked afterwards (``tests.distributed.run_on_ranks``) find both captured. Worth it before a spawn of
    more ranks than cores, which would otherwise capture the model once per rank."""
    import autotp.api
    from autotp.capture import example_inputs_of

    example = example_inputs_of(model, example_inputs)
    for mode in (True, False):
        autotp.api.capture(model, example, training=mode)


def sources() -> set:
    """The keys of the models whose captures are kept now."""
    return set(_SOURCES)


def forget(keys: set) -> None:
    """Drop the captures of the models of ``keys`` (a fixture's, at its teardown)."""
    for key in keys:
        _SOURCES.pop(key, None)


def counts() -> dict:
    """Hits and misses in this process so far."""
    return dict(_COUNTS)
