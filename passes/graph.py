"""Small read-only helpers over a captured torch.fx graph (shapes, parameters, argument paths).

Nothing here changes a graph: editing helpers live with the rewriter (``autotp.rewrite.graph_edit``).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import fx

ArgPath = tuple  # (index,) or (index, list_index) into node.args, or ("kw", name)


@dataclass(frozen=True)
class DividedBy:
    """A fix whose value is the argument's own (a size computed in the graph, ``B * H``) divided by ``by``."""

    by: int


@dataclass(frozen=True)
class ChunkOf:
    """A fix whose value is each rank's chunk of ``size`` cut into ``chunks`` (``placement.chunk_span``): a
    size of the vocabulary that tp does not divide, so that the ranks' values differ."""

    size: int
    chunks: int


@dataclass(frozen=True)
class WritesWithin:
    """A fix of an ``index_put`` whose index tensor indexes the split dim ``dim`` (of size ``size``, cut in
    ``chunks``): each rank writes only the indices in its chunk, shifted to its own positions
    (``rewrite.index_writes``)."""

    dim: int
    size: int
    chunks: int


def chunk_size(size: int, chunks: int) -> int | ChunkOf:
    """A static split size's value on each rank: the same on all when ``chunks`` divides it, else ``ChunkOf``."""
    return size // chunks if size % chunks == 0 else ChunkOf(size, chunks)


def meta_val(node) -> object:
    """The example value recorded for ``node`` by torch.export (a FakeTensor, a tuple, a SymInt)."""
    return node.meta.get("val") if isinstance(node, fx.Node) else None


def is_tensor(node) -> bool:
    """Whether ``node`` produces a single tensor."""
    return isinstance(meta_val(node), torch.Tensor)


SHAPE_META = "autotp_shape"
"""``node.meta`` key under which capture records a tensor's sizes as ints and sympy expressions (reading
a symbolic size's expression takes a private torch API, which only capture touches)."""


MUTATES_META = "autotp_mutates"
"""``node.meta`` key under which capture records the argument paths an op writes in place."""


def mutated_args(node: fx.Node) -> tuple:
    """The argument paths ``node`` writes in place (recorded by capture; none for nodes it did not see)."""
    return node.meta.get(MUTATES_META, ())


def sizes(node) -> tuple:
    """The sizes of the tensor ``node`` produces, as ints or sympy expressions for dynamic sizes."""
    recorded = node.meta.get(SHAPE_META)
    if recorded is not None:
        return recorded
    shape = meta_val(node).shape
    if not all(isinstance(d, int) for d in shape):
        raise LookupError(f"node {node.name} has symbolic sizes but no {SHAPE_META!r} record: "
                          "graphs must come from autotp's capture")
    return tuple(shape)


def rank(node) -> int:
    """Number of dimensions of ``node``'s tensor."""
    return meta_val(node).dim()


def tensor_args(node: fx.Node) -> Iterator[tuple[ArgPath, fx.Node]]:
    """Every (path, input node) of ``node`` that carries a tensor, including tensors inside lists."""
    for i, arg in enumerate(node.args):
        if isinstance(arg, fx.Node):
            yield (i,), arg
        elif isinstance(arg, (list, tuple)):
            for j, a in enumerate(arg):
                if isinstance(a, fx.Node):
                    yield (i, j), a
    for k, arg in node.kwargs.items():
        if isinstance(arg, fx.Node):
            yield ("kw", k), arg


def get_arg(node: fx.Node, path: ArgPath):
    """The argument of ``node`` at ``path``."""
    if path[0] == "kw":
        return node.kwargs[path[1]]
    arg = node.args[path[0]]
    return arg[path[1]] if len(path) > 1 else arg


def arg_or_default(node: fx.Node, index: int, name: str, default):
    """Positional-or-keyword argument of an ATen call."""
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def named_arg(node: fx.Node, name: str, default):
    """An ATen call's argument by its schema name, passed positionally or by keyword (``keepdim`` is the third
    argument of ``sum.dim_IntList`` but the fourth of ``var.dim``)."""
    schema = getattr(node.target, "_schema", None)
    names = [a.name for a in schema.arguments] if schema is not None else []
    index = names.index(name) if name in names else len(node.args)
    return arg_or_default(node, index, name, default)


def trainable_attrs(gm: fx.GraphModule) -> set[str]:
    """``get_attr`` targets of parameters that require grad."""
    return {name for name, p in gm.named_parameters() if p.requires_grad}


def frozen_attrs(gm: fx.GraphModule | None) -> set[str]:
    """``get_attr`` targets of parameters that do not require grad (a peft model's base weights)."""
    return set() if gm is None else {name for name, p in gm.named_parameters() if not p.requires_grad}


def frozen_activations(graph: fx.Graph, frozen: set[str], grad: set[str]) -> set[str]:
    """Computed nodes that read both a frozen parameter and a model input, through any chain, and carry no
    gradient (``grad``): a frozen embedding's output, the residual stream before the first adapter. They are
    activations as much as those the gradient flows through: a pipeline stage that needs one must receive it, not
    recompute it from the inputs (that would repeat the frozen work, and torch's stage set-up runs a later stage on
    empty tensors shaped like its inputs, so an embedding looked up there reads garbage ids)."""
    from_param: set[str] = set()
    from_input: set[str] = set()
    for node in graph.nodes:
        if node.op == "placeholder":
            from_input.add(node.name)
        elif node.op == "get_attr":
            if node.target in frozen:
                from_param.add(node.name)
        else:
            reads = {a.name for a in node.all_input_nodes}
            if reads & from_param:
                from_param.add(node.name)
            if reads & from_input:
                from_input.add(node.name)
    computed = {n.name for n in graph.nodes if n.op in ("call_function", "call_module", "call_method")}
    return (from_param & from_input & computed) - grad


def grad_nodes(graph: fx.Graph, trainable: set[str]) -> set[str]:
    """Names of nodes whose value depends on a trainable parameter (so gradients flow through them)."""
    out: set[str] = set()
    for node in graph.nodes:
        if node.op == "get_attr" and node.target in trainable:
            out.add(node.name)
        elif any(a.name in out for a in node.all_input_nodes) and not _gradless(node):
            out.add(node.name)
    return out


_SCALARS = (int, float, bool, torch.SymInt, torch.SymFloat, torch.SymBool)
"""Values that are numbers, not tensors: a size read off a tensor (``sym_size``, ``x.shape[1]``) or an ``item()``."""


def _gradless(node: fx.Node) -> bool:
    """An integer or boolean tensor (indices, masks), or a number (a size read off a tensor the gradient flows
    through, which only says how large it is): no gradient flows through it. Counting a size as carrying the
    gradient made a trace ask the shape of a number (a reshape to ``[x.size(0), -1, 64]`` reads the size node)."""
    value = meta_val(node)
    if isinstance(value, _SCALARS):
        return True
    return isinstance(value, torch.Tensor) and not (value.dtype.is_floating_point or value.dtype.is_complex)


CASTS = {torch.ops.aten.to.dtype, torch.ops.aten._to_copy.default}
"""Casts a parameter may be read through where it is used as it is (a router computed in float32)."""


def param_attr(node) -> str | None:
    """The ``get_attr`` target if ``node`` reads a module attribute directly, or a cast of it (a router computed
    in float32: ``F.linear(x.float(), W.float())``)."""
    if isinstance(node, fx.Node) and node.op == "call_function" and node.target in CASTS:
        node = node.args[0]
    return node.target if isinstance(node, fx.Node) and node.op == "get_attr" else None
