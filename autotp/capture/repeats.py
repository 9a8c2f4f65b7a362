"""Repeated blocks captured once: the graph of a deep model stamped out from two blocks of each run.

A transformer's blocks are one class built from one config, so torch.export traces the same ops again for every
block (most of the time a plan takes). Like torch's regional compilation, ``capture_repeated`` captures each run of
identical blocks (consecutive members of a ``ModuleList`` with one ``block_signature``: classes, parameter and buffer
shapes and dtypes, plain attributes, hooks) from its first two members only, checks that those two traced the same
graph (same ops, same constants, same sizes, the second reading the first's output where the first read its input),
and stamps out the rest of the run as copies of the second, reading the run's own parameters. The graph is the one
a full capture makes, node for node; where identity cannot be shown (a block whose graph differs from its
neighbour's, a value read across blocks, a model that cannot run shortened) it falls back to the full capture.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import re
from collections import OrderedDict
from dataclasses import dataclass

import torch
from torch import fx, nn
from torch.utils._pytree import tree_flatten

from autotp.capture.captured import WRAPPER_PREFIX, Captured
from autotp.capture.export import capture, tensor_aliases
from autotp.capture.torch_private import GUARDS_MODULE, mutated_args
from autotp.errors import CaptureError
from autotp.passes.graph import grad_nodes, trainable_attrs

_LEAST = 3
"""The shortest run worth stamping, in units: two units are always captured, to check the run against itself."""

_LONGEST_PERIOD = 8
"""The most blocks a repeated unit may hold: Swin alternates plain and shifted windows (2), Gemma 3 runs five
sliding-window layers, then a global one (6)."""


@dataclass(frozen=True)
class Run:
    """Consecutive blocks of one ``ModuleList`` that repeat a unit of ``period`` blocks (one block, or a pattern
    such as sliding, sliding, global): the first two units captured, the rest stamped."""

    path: str
    """The ``ModuleList``'s name in the model (``model.layers``)."""
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
class _Int:
    """An int attribute, and whether it equals the block's index (its ``layer_idx``)."""

    value: int
    is_index: bool


def _plain(value, index: int):
    """An attribute's value as the signature records it: plain data by value, ints with whether they are the
    block's index, a ``functools.partial`` by its function and arguments, anything else by identity (a config
    shared by every block compares equal)."""
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
        attrs = tuple(sorted((k, _plain(v, index)) for k, v in vars(m).items() if not k.startswith("_")))
        hooks = tuple(id(h) for d in (m._forward_hooks, m._forward_pre_hooks) for h in d.values())
        params = tuple((n, tuple(p.shape), p.dtype, p.requires_grad) for n, p in m.named_parameters(recurse=False))
        buffers = tuple((n, _tensor_key(b)) for n, b in m.named_buffers(recurse=False))
        parts.append((name, type(m), attrs, hooks, params, buffers))
    return tuple(parts)


def repeated_runs(model: nn.Module) -> list[Run]:
    """For each ``ModuleList`` that ends in at least ``_LEAST`` repeats of a unit of blocks, that run (the period
    that stamps the most blocks, the shorter on a tie). Only a run that ends its list is stamped: the shortened list
    is then a prefix of the full one, so every captured block sits at its own position (a forward that enumerates
    its blocks, ``config.layer_types[i]``, reads what it reads in full)."""
    runs = []
    for path, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or len(module) < _LEAST:
            continue
        keys = list(module._modules)
        signatures = [block_signature(module._modules[k], i) for i, k in enumerate(keys)]
        found = [run for p in range(1, min(_LONGEST_PERIOD, len(keys) // _LEAST) + 1)
                 if (run := _periodic_tail(path, keys, signatures, p)) is not None]
        if found:
            runs.append(max(found, key=lambda run: (len(run.stamped), -run.period)))
    return runs


def _periodic_tail(path: str, keys: list[str], signatures: list[tuple], period: int) -> Run | None:
    """The longest tail of the list in whole units of ``period`` blocks, each block the same as the one a unit
    later, if it holds at least ``_LEAST`` units."""
    start = len(keys) - period
    while start > 0 and same_blocks(signatures[start - 1], signatures[start - 1 + period]):
        start -= 1
    start += (len(keys) - start) % period  # whole units only
    return Run(path, tuple(keys[start:]), period) if (len(keys) - start) // period >= _LEAST else None


@contextlib.contextmanager
def _shortened(model: nn.Module, runs: list[Run]):
    """The model with its stamped blocks left out of their lists (the tail of each: the kept blocks keep their
    keys and positions, so their names are the full model's), put back afterwards."""
    saved = []
    for run in runs:
        lst = model.get_submodule(run.path)
        saved.append((lst, lst._modules))
        drop = set(run.stamped)
        lst._modules = OrderedDict((k, m) for k, m in lst._modules.items() if k not in drop)
    try:
        yield
    finally:
        for lst, modules in saved:
            lst._modules = modules


def capture_repeated(model: nn.Module, example_inputs, training: bool | None = None) -> Captured:
    """``capture``'s graph, made from two blocks of each run of identical blocks (module docstring); the full
    capture when the model has no such run or identity cannot be shown."""
    try:
        return stamp(model, example_inputs, training)
    except (NotRepeated, CaptureError):
        return capture(model, example_inputs, training)


def stamp(model: nn.Module, example_inputs, training: bool | None = None) -> Captured:
    """The model captured with each run's blocks past its second stamped out; ``NotRepeated`` when it has no run
    or a run's captured blocks differ, ``CaptureError`` when the shortened model cannot be captured."""
    runs = repeated_runs(model)
    if not runs:
        raise NotRepeated(f"{type(model).__name__} ends no ModuleList in {_LEAST} identical blocks")
    with _shortened(model, runs):
        small = capture(model, example_inputs, training)
    return _stamped(small, model, runs)


def _stamped(small: Captured, model: nn.Module, runs: list[Run]) -> Captured:
    """``small`` with each run's stamped blocks copied in, and the full model's names."""
    graph = small.graph
    blocks = {(run, u): _block_nodes(small, run.path, run.units[u]) for run in runs for u in (0, 1)}
    grad = grad_nodes(graph, trainable_attrs(small.module))  # what gradients flow through
    hand_over = {run: _chain(blocks[run, 0], blocks[run, 1], run, grad) for run in runs}
    reads = {run: _param_reads(graph, run) for run in runs}
    # capture reads every parameter, then every buffer: each stamped block's after the second block's of its kind
    after_reads = {kind[-1]: (run, kind) for run in runs for kind in _by_kind(model, reads[run]) if kind}
    after_block = {blocks[run, 1][-1]: run for run in runs}
    new = fx.Graph()
    env: dict = {}
    for node in graph.nodes:
        env[node] = new.node_copy(node, lambda n: env[n])
        if node in after_reads:
            _copy_param_reads(new, small.module, model, *after_reads[node], env)
        if node in after_block:
            run = after_block[node]
            _copy_blocks(new, blocks[run, 1], hand_over[run], reads[run], run, env)
    small.module.graph = new  # the setter recompiles (a second recompile cost as much again)
    small.state_keys = tuple(model.state_dict().keys())
    small.aliases = tensor_aliases(model)
    small.param_names = tuple(n for n, _ in model.named_parameters(remove_duplicate=False))
    return small


def _block_nodes(cap: Captured, path: str, unit: tuple[str, ...]) -> list[fx.Node]:
    """The nodes traced inside the blocks ``path.key`` of ``unit``, in order; they must be consecutive."""
    names = [f"{path}.{key}" for key in unit]
    # the input guards belong to the whole model, whatever module name the node after them lends them
    order = [n for n in cap.graph.nodes if n.op != "get_attr" and n.target != GUARDS_MODULE]
    inside = [i for i, n in enumerate(order)
              if any((m := cap.module_name(n)) == name or m.startswith(name + ".") for name in names)]
    if not inside or inside[-1] - inside[0] + 1 != len(inside):
        raise NotRepeated(f"{', '.join(names)}'s nodes are not consecutive")
    return order[inside[0]:inside[-1] + 1]


def _renamed(text: str, path: str, old: str, new: str) -> str:
    """``text`` (a ``get_attr`` target or module path starting with ``path``) with block ``path.old`` renamed
    ``path.new``."""
    return re.sub(rf"^{re.escape(path)}\.{re.escape(old)}(?=\.|$)", f"{path}.{new}", text)


def _renamed_unit(text: str, run: Run, old: int, new: int) -> str:
    """``text`` in unit ``old`` of ``run`` renamed to the block at its position in unit ``new``."""
    for a, b in zip(run.units[old], run.units[new]):
        renamed = _renamed(text, _attr_path(run), a, b)
        if renamed != text:
            return renamed
    return text


def _attr_path(run: Run) -> str:
    """The run's list as the captured module names it (``get_attr`` targets, module paths)."""
    return WRAPPER_PREFIX + run.path


def _chain(first: list[fx.Node], second: list[fx.Node], run: Run, grad: set[str]) -> dict[fx.Node, fx.Node]:
    """Check that ``second`` is ``first`` again, reading values of ``first`` where ``first`` read values from
    before it (the hidden state passed down the run), and that nothing after the run reads ``first``. Returns the
    hand-over: each node of ``first`` that ``second`` reads -> the node of ``second`` at its position, which the
    block after ``second`` reads in its place. ``NotRepeated`` when they differ in anything else."""
    # Sizes (``B * T``) and values ``computed_once`` traced in the first block are read by every later block, not
    # part of it (``_read_by_every_block``). A value handed down the run misread as one leaves different lengths.
    shared = _read_by_every_block(first, second, grad)
    first = [n for n in first if n not in shared]
    if len(first) != len(second):
        raise NotRepeated(f"units {run.units[:2]} of {run.path} traced {len(first)} and {len(second)} nodes")
    position = dict(zip(first, second))
    handed: dict[fx.Node, fx.Node] = {}
    for a, b in zip(first, second):
        if a.op != b.op or a.target != b.target or _shape_key(a) != _shape_key(b):
            raise NotRepeated(f"{a.name} and {b.name} differ")
        leaves_a, spec_a = tree_flatten((a.args, a.kwargs))
        leaves_b, spec_b = tree_flatten((b.args, b.kwargs))
        if spec_a != spec_b:
            raise NotRepeated(f"{a.name} and {b.name} take different arguments")
        for x, y in zip(leaves_a, leaves_b):
            _match_leaf(x, y, position, handed, run)
    inside_second = set(second)
    read_later = {u for n in first for u in n.users if u not in position and u not in inside_second}
    if read_later:
        raise NotRepeated(f"values of {run.path}.{run.units[0]} are read past the next unit "
                          f"({next(iter(read_later)).name})")
    return {y: position[y] for y in handed.values()}


def _match_leaf(x, y, position: dict, handed: dict, run: Run) -> None:
    """One argument of a node of the first block (``x``) against the second's (``y``)."""
    if not isinstance(x, fx.Node) or not isinstance(y, fx.Node):
        if isinstance(x, fx.Node) or isinstance(y, fx.Node) or type(x) is not type(y) or x != y:
            raise NotRepeated(f"constant {x!r} against {y!r}")
        return
    own = _renamed_unit(x.target, run, 0, 1) if x.op == "get_attr" else None
    if x in position:
        ok = position[x] is y
    elif own is not None and own != x.target:  # the first block's own tensor: the second reads its own
        ok = y.op == "get_attr" and y.target == own
    elif y is x:
        ok = True  # a value every block reads: positions, masks, rotary tables
    else:  # the hidden state: the second block reads the first's where the first read what came before it
        ok = y in position and x.op != "get_attr" and handed.setdefault(x, y) is y
    if not ok:
        raise NotRepeated(f"{x.name} against {y.name}")


def _read_by_every_block(first: list[fx.Node], second: list[fx.Node], grad: set[str]) -> set[fx.Node]:
    """The nodes of ``first`` that are values every later block reads, not part of the block (see ``_chain``): sizes
    and no-grad values ``second`` reads, what they are computed from, and the checks export emits beside such a
    value's op (``.to(dtype)`` traces ``_assert_tensor_metadata`` on its input: a node no one reads that writes
    nothing), which the later blocks, handed the value, never trace."""
    inside_second, inside_first = set(second), set(first)
    shared = {n for n in first if (_is_size(n) or n.name not in grad) and any(u in inside_second for u in n.users)}
    for n in reversed(first):  # and what those are computed from
        if n in shared:
            shared.update(a for a in n.all_input_nodes if a in inside_first and
                          (_is_size(a) or (not _is_size(n) and a.name not in grad)))
    if shared:
        shared.update(n for n in first if not n.users and n.name not in grad and not mutated_args(n)
                      and all(a in shared or a not in inside_first for a in n.all_input_nodes))
    return shared


def _is_size(node: fx.Node) -> bool:
    """Whether a node computes a size (a symbolic int), not a tensor."""
    return isinstance(node.meta.get("val"), (torch.SymInt, torch.SymFloat, torch.SymBool, int, float, bool))


def _shape_key(node: fx.Node) -> tuple:
    """What a node's recorded sizes and dtype say (symbolic sizes as text: both blocks share the capture's symbols)."""
    val = node.meta.get("val")
    vals = val if isinstance(val, (tuple, list)) else (val,)
    shapes = tuple((tuple(str(s) for s in v.shape), v.dtype) if isinstance(v, torch.Tensor) else repr(v) for v in vals)
    return shapes, repr(node.meta.get("autotp_shape"))


def _param_reads(graph: fx.Graph, run: Run) -> list[fx.Node]:
    """The ``get_attr`` nodes of the tensors of the run's second unit."""
    prefixes = tuple(f"{_attr_path(run)}.{key}." for key in run.units[1])
    reads = [n for n in graph.nodes if n.op == "get_attr" and n.target.startswith(prefixes)]
    if not reads:
        raise NotRepeated(f"{run.path}.{run.units[1]} reads no parameter")
    return reads


def _by_kind(model: nn.Module, reads: list[fx.Node]) -> tuple[list[fx.Node], list[fx.Node]]:
    """The reads of parameters, and of buffers."""
    params = [r for r in reads if isinstance(_tensor(model, r.target[len(WRAPPER_PREFIX):]), nn.Parameter)]
    return params, [r for r in reads if r not in params]


def _copy_param_reads(new: fx.Graph, root: nn.Module, model: nn.Module, run: Run, reads: list[fx.Node],
                      env: dict) -> None:
    """A ``get_attr`` for each stamped unit's tensors under the full model's names (``env[unit, read]``), each
    tensor registered on the captured module as capture registers the others."""
    for unit in range(2, len(run.units)):
        for read in reads:
            target = _renamed_unit(read.target, run, 1, unit)
            _register(root, target, _tensor(model, target[len(WRAPPER_PREFIX):]))
            copied = new.get_attr(target)
            copied.meta = dict(read.meta)
            env[unit, read] = copied


def _tensor(model: nn.Module, name: str) -> torch.Tensor:
    """The model's parameter or buffer ``name``."""
    module, _, short = name.rpartition(".")
    owner = model.get_submodule(module)
    return owner._parameters[short] if short in owner._parameters else owner._buffers[short]


def _register(root: nn.Module, target: str, tensor: torch.Tensor) -> None:
    """Put ``tensor`` at dotted ``target`` in ``root``, making the empty modules on the way."""
    *path, name = target.split(".")
    module = root
    for part in path:
        if not hasattr(module, part):
            module.add_module(part, nn.Module())
        module = getattr(module, part)
    if isinstance(tensor, nn.Parameter):
        module.register_parameter(name, tensor)
    else:
        module.register_buffer(name, tensor)


def _copy_blocks(new: fx.Graph, second: list[fx.Node], hand_over: dict, reads: list[fx.Node], run: Run,
                 env: dict) -> None:
    """The stamped units, each a copy of ``second`` reading the unit before it where ``second`` read the first;
    readers after the run read the last copy's values."""
    previous = {n: env[n] for n in second}  # the unit before the one being copied: the second, at first
    own_reads = set(reads)
    for unit in range(2, len(run.units)):
        current: dict[fx.Node, fx.Node] = {}

        def arg(n: fx.Node) -> fx.Node:
            if n in current:
                return current[n]
            if n in hand_over:  # the hidden state: the previous block's value at the handed position
                return previous[hand_over[n]]
            if n in own_reads:
                return env[unit, n]
            return env[n]  # what every block reads

        for node in second:
            copied = new.node_copy(node, arg)
            copied.meta = dict(node.meta)
            stack = node.meta.get("nn_module_stack")
            if stack:
                copied.meta["nn_module_stack"] = {
                    k: (_renamed_unit(path, run, 1, unit), cls) for k, (path, cls) in stack.items()}
            current[node] = copied
        previous = current
    for n in second:
        env[n] = previous[n]
