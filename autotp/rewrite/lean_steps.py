"""Fewer operator calls in a generation step: a decode step runs once per token, and on a CPU host every aten call
in it costs a few microseconds of dispatch whatever its size (a 6-layer Llama's decode step had 483 calls for
about 13 ms of weight reads at tp=2).

Three cuts, each computing exactly what the graph computed:

- export's ``_assert_tensor_metadata`` checks (the step's inputs are made by ``capture.kv_cache.step_inputs``
  with the captured dtypes);
- operators that return their input unchanged: a cast to the dtype the value already has (``aten.to`` returns
  ``self`` then), and a slice over a whole dimension or an ``alias`` (``x[:, :]``, a view of every element);
- common subexpressions: a pure operator applied again to the same inputs (transformers recomputes the rotary
  tables' ``unsqueeze`` and the cache position in every layer), only where no input can be written in place in
  between.
"""

from __future__ import annotations

import torch
from torch import fx

from autotp.torch_private import op_schema

aten = torch.ops.aten

WHOLE_END = 2**62
"""A slice ending at or past this index runs to the end of its dimension (export writes ``sys.maxsize``)."""


def lean_step(gm: fx.GraphModule, casts_hold: bool) -> fx.GraphModule:
    """``gm`` with the cuts above, recompiled. ``casts_hold`` says the graph will read tensors of the dtypes it
    was captured with (only then is a cast known to be a no-op from the captured values' dtypes)."""
    _drop_metadata_checks(gm.graph)
    _drop_identities(gm.graph, casts_hold)
    _merge_common(gm.graph)
    gm.recompile()
    return gm


def _drop_metadata_checks(graph: fx.Graph) -> None:
    for node in list(graph.find_nodes(op="call_function", target=aten._assert_tensor_metadata.default)):
        if not node.users:
            graph.erase_node(node)


def _value(node) -> torch.Tensor | None:
    """The captured value of ``node`` (a fake tensor), if it is a node with one."""
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return val if isinstance(val, torch.Tensor) else None


def _same_device(device, val: torch.Tensor) -> bool:
    return device is None or torch.device(device) == val.device


def is_identity(node: fx.Node, casts_hold: bool) -> bool:
    """Whether ``node`` returns its first argument itself or a view of all of it, unchanged."""
    if node.op != "call_function" or not node.args:
        return False
    val, kwargs = _value(node.args[0]), node.kwargs
    if node.target is aten.alias.default:
        return True
    if node.target is aten.slice.Tensor:
        _, dim, start, end, step = (*node.args, *[None] * (5 - len(node.args)))[:5]
        return start in (None, 0) and (end is None or (isinstance(end, int) and end >= WHOLE_END)) and step in (None, 1)
    if val is None or not casts_hold or kwargs.get("copy") or kwargs.get("memory_format") not in (
            None, torch.preserve_format):
        return False
    if node.target is aten.to.dtype:
        dtype = node.args[1] if len(node.args) > 1 else kwargs.get("dtype")
        return dtype == val.dtype and len(node.args) <= 2
    if node.target is aten.to.dtype_layout:
        return (len(node.args) == 1 and kwargs.get("dtype", val.dtype) == val.dtype
                and kwargs.get("layout", torch.strided) in (None, val.layout)
                and _same_device(kwargs.get("device"), val))
    return False


def _drop_identities(graph: fx.Graph, casts_hold: bool) -> None:
    for node in list(graph.nodes):
        if is_identity(node, casts_hold) and isinstance(node.args[0], fx.Node):
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)


def _schema(node: fx.Node):
    return op_schema(node.target) if node.op == "call_function" else None


def _writes(node: fx.Node) -> list[fx.Node]:
    """The nodes whose tensors ``node`` writes in place."""
    schema = _schema(node)
    if schema is None:
        return []
    return [a for arg, a in zip(schema.arguments, node.args)
            if arg.alias_info is not None and arg.alias_info.is_write and isinstance(a, fx.Node)]


def _is_view(node: fx.Node) -> bool:
    schema = _schema(node)
    return schema is not None and any(r.alias_info is not None for r in schema.returns)


def changing_values(graph: fx.Graph) -> set[fx.Node]:
    """Every node whose value may differ depending on when it is read: those written in place, the tensors they
    are views of, and everything computed from any of them (a conservative closure). Any call_module is treated
    as writing its inputs (a collective may reduce in place)."""
    written = {w for node in graph.nodes for w in _writes(node)}
    written |= {a for node in graph.nodes if node.op == "call_module" for a in node.all_input_nodes}
    stack = list(written)
    while stack:  # a write through a view writes its base
        node = stack.pop()
        if _is_view(node):
            for base in node.all_input_nodes[:1]:
                if base not in written:
                    written.add(base)
                    stack.append(base)
    changing = set()
    for node in graph.nodes:
        if node in written or any(a in changing for a in node.all_input_nodes):
            changing.add(node)
    return changing


def _pure(node: fx.Node) -> bool:
    schema = _schema(node)
    return (schema is not None and not schema.is_mutable and not _writes(node)
            and torch.Tag.nondeterministic_seeded not in node.target.tags)


def _key(node: fx.Node):
    def freeze(a):
        if isinstance(a, (list, tuple)):
            return (type(a).__name__, *map(freeze, a))
        if isinstance(a, dict):
            return tuple(sorted((k, freeze(v)) for k, v in a.items()))
        return a if isinstance(a, fx.Node) else (type(a).__name__, repr(a))
    return node.target, freeze(node.args), freeze(node.kwargs)


def _merge_common(graph: fx.Graph) -> None:
    changing = changing_values(graph)
    first: dict = {}
    for node in list(graph.nodes):
        if not _pure(node) or node in changing:
            continue
        key = _key(node)
        if key in first:
            node.replace_all_uses_with(first[key])
            graph.erase_node(node)
        else:
            first[key] = node
