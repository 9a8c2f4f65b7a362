"""Runs of repeated blocks: the tail of a ``ModuleList`` or ``Sequential`` whose blocks repeat a unit, found from
the modules alone (no tracing), for ``capture.repeats`` to capture two units of and stamp out the rest."""

from __future__ import annotations

import functools
import hashlib
import math
import re
from dataclasses import dataclass

import torch
from torch import nn

from autotp.capture.stamping.block_floats import Key
from autotp.capture.core.captured import WRAPPER_PREFIX

LEAST = 3
"""The shortest run worth stamping, in units: two units are always captured, to check the run against itself."""

_LONGEST_PERIOD = 8
"""The most blocks a repeated unit may hold: Swin alternates plain and shifted windows (2), Gemma 3 runs five
sliding-window layers, then a global one (6)."""


@dataclass(frozen=True)
class Run:
    """Consecutive blocks of one ``ModuleList`` or ``Sequential`` that repeat a unit of ``period`` blocks (one
    block, or a pattern such as sliding, sliding, global): the first two units captured, the rest stamped."""

    path: str
    """The list's name in the model (``model.layers``)."""
    keys: tuple[str, ...]
    """The blocks' keys in the list, in order (``("3", "4", ..., "60")``): whole units."""
    period: int = 1
    """Blocks per unit."""

    @property
    def units(self) -> tuple[tuple[str, ...], ...]:
        """The keys of each unit, in order."""
        return tuple(self.keys[i:i + self.period] for i in range(0, len(self.keys), self.period))

    @property
    def stamped(self) -> tuple[str, ...]:
        """The blocks copied from the second unit rather than captured."""
        return self.keys[2 * self.period:]


class NotRepeated(Exception):
    """The captured representatives do not prove the run identical (internal: the caller falls back)."""


@dataclass(frozen=True)
class _Float:
    """A float attribute: blocks may differ in one (``capture.block_floats`` then checks what the graph makes of
    it), but a zero only matches a zero: code branches on it (``if drop_prob == 0.0: return x``), so the first
    block of a rate rising from zero is left out of the run rather than failing the run's check."""

    value: float


@dataclass(frozen=True)
class _Int:
    """An int attribute, and whether it equals the block's index (its ``layer_idx``)."""

    value: int
    is_index: bool


def _plain(value, index: int, top: bool = False):
    """An attribute's value as the signature records it: plain data by value, ints with whether they are the
    block's index, a ``functools.partial`` by its function and arguments, anything else by identity (a config
    shared by every block compares equal). A float attribute of its own (``top``) may vary (``_Float``)."""
    if top and _is_float(value):
        return _Float(value)
    if isinstance(value, bool) or value is None or isinstance(value, (float, str)):
        return value
    if isinstance(value, int):
        return _Int(value, value == index)
    if isinstance(value, (tuple, list)):
        return tuple(_plain(v, index) for v in value)
    if isinstance(value, functools.partial):  # made per block (GELUTanh's act): the same call if its parts are
        return ("partial", id(value.func), _plain(value.args, index),
                tuple(sorted((k, _plain(v, index)) for k, v in value.keywords.items())))
    return ("id", id(value))


def same_blocks(a, b) -> bool:
    """Whether two signatures (``block_signature``) describe the same block: equal, but for ints that are each
    block's own index (a coincidence, an int equal to one block's index, still has to be equal)."""
    if isinstance(a, _Int) and isinstance(b, _Int):
        return a.value == b.value or (a.is_index and b.is_index)
    if isinstance(a, _Float) and isinstance(b, _Float):
        return a.value == b.value or (a.value != 0 and b.value != 0)
    if isinstance(a, tuple) and isinstance(b, tuple):
        return len(a) == len(b) and all(same_blocks(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def _tensor_key(t: torch.Tensor) -> tuple:
    """A buffer by shape and dtype, and by value where it has one (a branch could read it)."""
    if t.device.type == "meta":
        return (tuple(t.shape), t.dtype)
    return (tuple(t.shape), t.dtype, hashlib.sha1(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()).hexdigest())


def block_signature(block: nn.Module, index: int) -> tuple:
    """What makes two blocks trace the same graph, as far as it can be read without tracing: each submodule's
    class, parameters (shape, dtype, requires_grad), buffers, plain attributes and hooks."""
    parts = []
    for name, m in block.named_modules():
        attrs = tuple(sorted((k, _plain(v, index, top=True)) for k, v in vars(m).items() if not k.startswith("_")))
        hooks = tuple(id(h) for d in (m._forward_hooks, m._forward_pre_hooks) for h in d.values())
        params = tuple((n, tuple(p.shape), p.dtype, p.requires_grad) for n, p in m.named_parameters(recurse=False))
        buffers = tuple((n, _tensor_key(b)) for n, b in m.named_buffers(recurse=False))
        parts.append((name, type(m), attrs, hooks, params, buffers))
    return tuple(parts)


def repeated_runs(model: nn.Module) -> list[Run]:
    """For each ``ModuleList`` or ``Sequential`` that ends in at least ``LEAST`` repeats of a unit of blocks, that
    run (the period that stamps the most blocks, the shorter on a tie). Only a run that ends its list is stamped:
    the shortened list is then a prefix of the full one, so every captured block sits at its own position (a
    forward that enumerates its blocks, ``config.layer_types[i]``, reads what it reads in full)."""
    runs = []
    for path, module in model.named_modules():
        # a Sequential runs its members in order, as a forward runs a ModuleList's (timm's and torchvision's blocks)
        if not isinstance(module, (nn.ModuleList, nn.Sequential)) or len(module) < LEAST:
            continue
        keys = list(module._modules)
        signatures = [block_signature(module._modules[k], i) for i, k in enumerate(keys)]
        found = [run for p in range(1, min(_LONGEST_PERIOD, len(keys) // LEAST) + 1)
                 if (run := _periodic_tail(path, keys, signatures, p)) is not None]
        if found:
            runs.append(max(found, key=lambda run: (len(run.stamped), -run.period)))
    return runs


def _periodic_tail(path: str, keys: list[str], signatures: list[tuple], period: int) -> Run | None:
    """The longest tail of the list in whole units of ``period`` blocks, each block the same as the one a unit
    later, if it holds at least ``LEAST`` units."""
    start = len(keys) - period
    while start > 0 and same_blocks(signatures[start - 1], signatures[start - 1 + period]):
        start -= 1
    start += (len(keys) - start) % period  # whole units only
    return Run(path, tuple(keys[start:]), period) if (len(keys) - start) // period >= LEAST else None


def _is_float(value) -> bool:
    return isinstance(value, float) and not math.isnan(value)


def unit_blocks(model: nn.Module, run: Run, unit: int) -> list[nn.Module]:
    """The blocks of unit ``unit`` of ``run``, in order."""
    blocks = model.get_submodule(run.path)._modules
    return [blocks[key] for key in run.units[unit]]


def varying_floats(model: nn.Module, run: Run) -> frozenset[Key]:
    """The float attributes whose value is not the same in every unit of ``run`` (a drop rate per block)."""
    units = [unit_blocks(model, run, u) for u in range(len(run.units))]
    keys = set()
    for position, block in enumerate(units[0]):
        for path, module in block.named_modules():
            for name, value in vars(module).items():
                if not name.startswith("_") and _is_float(value) and any(
                        getattr(unit[position].get_submodule(path), name) != value for unit in units[1:]):
                    keys.add((position, path, name))
    return frozenset(keys)


def renamed(text: str, path: str, old: str, new: str) -> str:
    """``text`` (a ``get_attr`` target or module path starting with ``path``) with block ``path.old`` renamed
    ``path.new``."""
    return re.sub(rf"^{re.escape(path)}\.{re.escape(old)}(?=\.|$)", f"{path}.{new}", text)


def renamed_unit(text: str, run: Run, old: int, new: int) -> str:
    """``text`` in unit ``old`` of ``run`` renamed to the block at its position in unit ``new``."""
    for a, b in zip(run.units[old], run.units[new]):
        new_text = renamed(text, attr_path(run), a, b)
        if new_text != text:
            return new_text
    return text


def attr_path(run: Run) -> str:
    """The run's list as the captured module names it (``get_attr`` targets, module paths)."""
    return WRAPPER_PREFIX + run.path


