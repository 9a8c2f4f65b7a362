"""Repeated blocks captured once: the graph of a deep model stamped out from two blocks of each run.

A transformer's blocks are one class built from one config, so torch.export traces the same ops again for every
block (most of the time a plan takes). Like torch's regional compilation, ``capture_repeated`` captures each run of
identical blocks (consecutive members of a ``ModuleList`` or ``Sequential`` with one ``block_signature``: classes,
parameter and buffer shapes and dtypes, plain attributes, hooks; ``capture.runs``) from its first two units only,
checks that those two traced the same graph (same ops, same sizes, the second reading the first's output where the
first read its input, the same constants but where a float attribute that differs block by block made them:
``capture.block_floats``), and stamps out the rest of the run as copies of the second, reading the run's own
parameters and holding constants made from its own floats. The graph is the one a full capture makes, node for
node; where identity cannot be shown (a block whose graph differs from its neighbour's, a value read across blocks,
a model that cannot run shortened, tried with dynamic sizes only) it falls back to the full capture.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import fx, nn
from autotp.torch_private.pytree import tree_flatten, tree_unflatten

from autotp.capture.stamping.block_floats import FAILED, Ambiguous, Constants, Log, Values, evaluated, tracked, unit_values
from autotp.capture.core.captured import WRAPPER_PREFIX, Captured
from autotp.capture.core.export import capture, tensor_aliases
from autotp.capture.stamping.runs import (LEAST, NotRepeated, Run, attr_path, renamed_unit, repeated_runs, unit_blocks,
                                 varying_floats)
from autotp.capture.speedups.speedup_switch import speedups_enabled
from autotp.torch_private import GUARDS_MODULE, capturing, mutated_args
from autotp.errors import CaptureError
from autotp.passes.graph import grad_nodes, trainable_attrs

__all__ = ["NotRepeated", "Run", "capture_repeated", "repeated_runs", "stamp"]


@dataclass
class _Floats:
    """A run's float attributes that vary from unit to unit (``capture.block_floats``): what tracking them
    recorded while its two units were captured, and each unit's values."""

    made: Constants
    """Every float the tracking recorded, computed again for each unit."""
    values: list[Values]
    """Each unit's values of the varying attributes."""

    def explain(self, x, y) -> Callable[[Values], float] | None:
        """How a float constant that is ``x`` in the first unit and ``y`` in the second is computed from a unit's
        values (``of(values)``); None for anything else, a constant the same in every unit included.
        ``NotRepeated`` for a constant recorded computations explain but not one way for every unit."""
        if type(x) is not float or type(y) is not float:
            return None
        try:
            return self.made.made_as(x, y)
        except Ambiguous as e:
            raise NotRepeated(f"a constant ({e}) of the first two units is made otherwise in a later one") from e


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


def capture_repeated(model: nn.Module, example_inputs, training: bool | None = None, *,
                     speedups: bool | None = None) -> Captured:
    """``capture``'s graph, made from two blocks of each run of identical blocks (module docstring); the full
    capture when the model has no such run or identity cannot be shown. Stamping is a speed-up: with ``speedups``
    False (None: ``AUTOTP_CAPTURE_SPEEDUPS`` decides) the full capture, with no speed-up. The capture lock is held
    throughout: stamping shortens the model's block lists while it captures."""
    if not speedups_enabled(speedups):
        return capture(model, example_inputs, training, speedups=False)
    with capturing():
        try:
            return stamp(model, example_inputs, training)
        except (NotRepeated, CaptureError):
            return capture(model, example_inputs, training)


def stamp(model: nn.Module, example_inputs, training: bool | None = None) -> Captured:
    """The model captured with each run's blocks past its second stamped out; ``NotRepeated`` when it has no run
    or a run's captured blocks differ, ``CaptureError`` when the shortened model cannot be captured."""
    runs = repeated_runs(model)
    if not runs:
        raise NotRepeated(f"{type(model).__name__} ends no ModuleList or Sequential in {LEAST} identical blocks")
    varying = {run: keys for run in runs if (keys := varying_floats(model, run))}
    with _shortened(model, runs), contextlib.ExitStack() as stack:
        logs = {run: stack.enter_context(tracked([unit_blocks(model, run, u) for u in (0, 1)], keys))
                for run, keys in varying.items()}
        small = capture(model, example_inputs, training, fallbacks=False)  # else the full capture, at once
    floats = {run: _run_floats(model, run, varying[run], log) for run, log in logs.items()}
    return _stamped(small, model, runs, floats)


def _run_floats(model: nn.Module, run: Run, keys, log: Log) -> _Floats:
    """``run``'s varying floats, checked: each differs between the two captured units (else a constant of one
    value in both could be made from it), and every decision the capture took on them comes out the same in
    every stamped unit."""
    values = [unit_values(unit_blocks(model, run, u), keys) for u in range(len(run.units))]
    if any(values[0][key] == values[1][key] for key in keys):
        raise NotRepeated(f"{run.path}: a float attribute is the same in the captured units, not in the rest")
    if not all(log.decided_alike(v) for v in values[2:]):
        raise NotRepeated(f"{run.path}: a float attribute decides a branch differently in a later block")
    return _Floats(Constants(log, values), values)


def _stamped(small: Captured, model: nn.Module, runs: list[Run], floats: dict[Run, _Floats]) -> Captured:
    """``small`` with each run's stamped blocks copied in, and the full model's names."""
    graph = small.graph
    blocks = {(run, u): _block_nodes(small, run.path, run.units[u]) for run in runs for u in (0, 1)}
    grad = grad_nodes(graph, trainable_attrs(small.module))  # what gradients flow through
    lifted = _lifted(small.module, model)
    chains = {run: _chain(blocks[run, 0], blocks[run, 1], run, grad, lifted, floats.get(run)) for run in runs}
    reads = {run: _param_reads(graph, run) for run in runs}
    # capture reads every parameter, then every buffer, then every constant: each stamped block's after the second
    # block's of its kind
    after_reads = {kind[-1]: (run, kind) for run in runs for kind in _by_kind(model, reads[run], lifted) if kind}
    after_block = {blocks[run, 1][-1]: run for run in runs}
    new = fx.Graph()
    env: dict = {}
    for node in graph.nodes:
        env[node] = new.node_copy(node, lambda n: env[n])
        if node in after_reads:
            _copy_param_reads(new, small.module, model, *after_reads[node], env, lifted)
        if node in after_block:
            run = after_block[node]
            _copy_blocks(new, blocks[run, 1], chains[run], reads[run], run, env, floats.get(run))
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


@dataclass
class _Chain:
    """How the second unit follows the first (``_chain``)."""

    hand_over: dict[fx.Node, fx.Node]
    """Each node of the first unit that the second reads -> the node of the second at its position, which the
    unit after the second reads in its place."""
    per_unit: dict[fx.Node, list[tuple[int, Callable[[Values], float]]]]
    """Nodes of the second unit holding constants made from a varying float: (argument leaf, ``of(values)``)."""


def _chain(first: list[fx.Node], second: list[fx.Node], run: Run, grad: set[str],
           lifted: dict[str, torch.Tensor], floats: _Floats | None) -> _Chain:
    """Check that ``second`` is ``first`` again, reading values of ``first`` where ``first`` read values from
    before it (the hidden state passed down the run), holding constants made from the run's varying floats where
    they differ, and that nothing after the run reads ``first``. ``NotRepeated`` when they differ in anything
    else."""
    # Sizes (``B * T``) and values ``computed_once`` traced in the first block are read by every later block, not
    # part of it (``_read_by_every_block``). A value handed down the run misread as one leaves different lengths.
    shared = _read_by_every_block(first, second, grad)
    first = [n for n in first if n not in shared]
    if len(first) != len(second):
        raise NotRepeated(f"units {run.units[:2]} of {run.path} traced {len(first)} and {len(second)} nodes")
    position = dict(zip(first, second))
    handed: dict[fx.Node, fx.Node] = {}
    per_unit: dict[fx.Node, list[tuple[int, Callable[[Values], float]]]] = {}
    for a, b in zip(first, second):
        if a.op != b.op or a.target != b.target or _shape_key(a) != _shape_key(b):
            raise NotRepeated(f"{a.name} and {b.name} differ")
        leaves_a, spec_a = tree_flatten((a.args, a.kwargs))
        leaves_b, spec_b = tree_flatten((b.args, b.kwargs))
        if spec_a != spec_b:
            raise NotRepeated(f"{a.name} and {b.name} take different arguments")
        for i, (x, y) in enumerate(zip(leaves_a, leaves_b)):
            if (of := floats and floats.explain(x, y)) is not None:
                per_unit.setdefault(b, []).append((i, of))
            else:
                _match_leaf(x, y, position, handed, run, lifted)
    inside_second = set(second)
    read_later = {u for n in first for u in n.users if u not in position and u not in inside_second}
    if read_later:
        raise NotRepeated(f"values of {run.path}.{run.units[0]} are read past the next unit "
                          f"({next(iter(read_later)).name})")
    return _Chain({y: position[y] for y in handed.values()}, per_unit)


def _match_leaf(x, y, position: dict, handed: dict, run: Run, lifted: dict[str, torch.Tensor]) -> None:
    """One argument of a node of the first block (``x``) against the second's (``y``)."""
    if not isinstance(x, fx.Node) or not isinstance(y, fx.Node):
        if isinstance(x, fx.Node) or isinstance(y, fx.Node) or type(x) is not type(y) or x != y:
            raise NotRepeated(f"constant {x!r} against {y!r}")
        return
    own = renamed_unit(x.target, run, 0, 1) if x.op == "get_attr" else None
    if x in position:
        ok = position[x] is y
    elif own is not None and x.target in lifted:  # a tensor the block's code made: the second's, equal
        ok = y.target in lifted and _same_constant(lifted[x.target], lifted[y.target]) and \
            own.rpartition(".")[0] == y.target.rpartition(".")[0]
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
    prefixes = tuple(f"{attr_path(run)}.{key}." for key in run.units[1])
    reads = [n for n in graph.nodes if n.op == "get_attr" and n.target.startswith(prefixes)]
    if not reads:
        raise NotRepeated(f"{run.path}.{run.units[1]} reads no parameter")
    return reads


def _by_kind(model: nn.Module, reads: list[fx.Node], lifted: dict) -> tuple[list[fx.Node], ...]:
    """The reads of parameters, of buffers and of lifted constants (``_lifted``)."""
    state = [r for r in reads if r.target not in lifted]
    params = [r for r in state if isinstance(_tensor(model, r.target[len(WRAPPER_PREFIX):]), nn.Parameter)]
    return params, [r for r in state if r not in params], [r for r in reads if r.target in lifted]


def _lifted(root: nn.Module, model: nn.Module) -> dict[str, torch.Tensor]:
    """The tensors the captured graph reads that are not the model's parameters or buffers, by target: those
    export lifted from the code (a table a block builds, or an ``lru_cache`` hands every block)."""
    state = {WRAPPER_PREFIX + name for name, _ in (*model.named_parameters(), *model.named_buffers())}
    return {n.target: _attr(root, n.target) for n in root.graph.nodes
            if n.op == "get_attr" and n.target not in state and isinstance(_attr(root, n.target), torch.Tensor)}


def _attr(root: nn.Module, target: str):
    module, _, name = target.rpartition(".")
    return getattr(root.get_submodule(module), name)


def _same_constant(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two lifted constants are one value: same dtype and shape and equal, not fake."""
    return a.dtype == b.dtype and a.shape == b.shape and a.device.type != "meta" and torch.equal(a, b)


def _copy_param_reads(new: fx.Graph, root: nn.Module, model: nn.Module, run: Run, reads: list[fx.Node],
                      env: dict, lifted: dict) -> None:
    """A ``get_attr`` for each stamped unit's tensors under the full model's names (``env[unit, read]``), each
    tensor registered on the captured module as capture registers the others (a constant: the second unit's,
    under the stamped block's name)."""
    for unit in range(2, len(run.units)):
        for read in reads:
            target = renamed_unit(read.target, run, 1, unit)
            if read.target in lifted:
                module, _, name = target.rpartition(".")
                _register(root, module, None)
                setattr(root.get_submodule(module), name, lifted[read.target])
            else:
                _register(root, target, _tensor(model, target[len(WRAPPER_PREFIX):]))
            copied = new.get_attr(target)
            copied.meta = dict(read.meta)
            env[unit, read] = copied


def _tensor(model: nn.Module, name: str) -> torch.Tensor:
    """The model's parameter or buffer ``name``."""
    module, _, short = name.rpartition(".")
    owner = model.get_submodule(module)
    return owner._parameters[short] if short in owner._parameters else owner._buffers[short]


def _register(root: nn.Module, target: str, tensor: torch.Tensor | None) -> None:
    """Put ``tensor`` at dotted ``target`` in ``root``, making the empty modules on the way (only those, if
    ``tensor`` is None)."""
    *path, name = target.split(".")
    module = root
    for part in path if tensor is not None else (*path, name):
        if not hasattr(module, part):
            module.add_module(part, nn.Module())
        module = getattr(module, part)
    if tensor is None:
        return
    if isinstance(tensor, nn.Parameter):
        module.register_parameter(name, tensor)
    else:
        module.register_buffer(name, tensor)


def _copy_blocks(new: fx.Graph, second: list[fx.Node], chain: _Chain, reads: list[fx.Node], run: Run,
                 env: dict, floats: _Floats | None) -> None:
    """The stamped units, each a copy of ``second`` reading the unit before it where ``second`` read the first,
    with its own constants where they are made from its floats; readers after the run read the last copy's
    values."""
    hand_over = chain.hand_over
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
            if node in chain.per_unit:
                leaves, spec = tree_flatten((copied.args, copied.kwargs))
                for i, of in chain.per_unit[node]:
                    leaves[i] = evaluated(of, floats.values[unit])
                    if leaves[i] is FAILED:  # a stamped block's rate makes the constant fail: traced, it would too
                        raise NotRepeated(f"{run.path}.{run.units[unit]}: a constant cannot be made from its floats")
                copied.args, copied.kwargs = tree_unflatten(leaves, spec)
            stack = node.meta.get("nn_module_stack")
            if stack:
                copied.meta["nn_module_stack"] = {
                    k: (renamed_unit(path, run, 1, unit), cls) for k, (path, cls) in stack.items()}
            current[node] = copied
        previous = current
    for n in second:
        env[n] = previous[n]
