"""The rank graphs' floating dtypes: free to follow autocast, and retyped with the module's tensors.

torch.export bakes the dtypes the model ran in at capture into the graph: every ``.to(dtype)`` becomes an
``aten._assert_tensor_metadata`` check that its input has the captured dtype, then the cast; ``torch.full``,
``arange``, a softmax's ``dtype=`` carry it as a constant. Two things the user does on purpose change the dtypes a
graph sees:

- ``torch.autocast`` around the module: a linear's output is then bfloat16, and the check on the ``.to`` after it
  raised torch's raw "Tensor dtype mismatch". The checks are dropped (``drop_dtype_checks``); the casts stay, and
  compute exactly what the model's own code computes under autocast where it cast to a fixed dtype (HF's
  ``logits.float()``, RMSNorm's ``.to(torch.float32)``).
- ``pm.to(dtype)``: the parameters change dtype. Cast down to bf16 or fp16, the graphs keep their constants and
  run under autocast (``runtime.precision``); otherwise the captured dtype's constants follow the parameters
  (``retype``). At capture the model's casts to its input's dtype and its explicit upcasts (RMSNorm's variance in
  fp32, the loss's ``.float()``) were both casts to the one dtype it ran in, so retyped, both follow the new dtype.
"""

from __future__ import annotations

import torch
from torch import fx

aten = torch.ops.aten

CAPTURED_ARGS = "autotp_captured_args"
"""``node.meta`` key: the node's arguments as captured, kept at its first retype so that every later retype
(bfloat16, then back to float32) maps the captured constants, never its own earlier output."""


def drop_dtype_checks(gm: fx.GraphModule) -> int:
    """Remove export's ``_assert_tensor_metadata`` checks (dtype, device, layout of a ``.to``'s input), which
    nothing reads: autocast and ``pm.to`` change a value's dtype on purpose. Returns how many; not recompiled
    (the caller does)."""
    graph = gm.graph
    checks = [n for n in graph.find_nodes(op="call_function", target=aten._assert_tensor_metadata.default)
              if not n.users]
    for node in checks:
        graph.erase_node(node)
    return len(checks)


def retype(gm: fx.GraphModule, captured: torch.dtype, new: torch.dtype) -> bool:
    """Every ``captured`` dtype constant in ``gm``'s nodes (and its submodules') made ``new``, from the arguments
    as captured; recompiled where something changed. Returns whether anything did."""
    changed_any = False
    for module in gm.modules():
        if isinstance(module, fx.GraphModule) and _retype_graph(module.graph, captured, new):
            module.recompile()
            changed_any = True
    return changed_any


def _retype_graph(graph: fx.Graph, captured: torch.dtype, new: torch.dtype) -> bool:
    def swap(value):
        return new if isinstance(value, torch.dtype) and value == captured else value

    changed = False
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        args, kwargs = node.meta.get(CAPTURED_ARGS, (node.args, node.kwargs))
        new_args, new_kwargs = fx.node.map_aggregate(args, swap), fx.node.map_aggregate(kwargs, swap)
        if new_args == node.args and new_kwargs == node.kwargs:
            continue
        node.meta.setdefault(CAPTURED_ARGS, (node.args, node.kwargs))
        node.args, node.kwargs, changed = new_args, new_kwargs, True
    return changed


def floating_dtype(tensors) -> torch.dtype | None:
    """The dtype most of ``tensors``' floating elements have (None: no floating tensor)."""
    counts: dict[torch.dtype, int] = {}
    for t in tensors:
        if t.is_floating_point():
            counts[t.dtype] = counts.get(t.dtype, 0) + t.numel()
    return max(counts, key=counts.get) if counts else None


def cast_parameters(gm: fx.GraphModule, dtype: torch.dtype, only: set[int] | None = None) -> int:
    """Read every floating parameter of ``gm`` (of ``only``, ids, when given) through a cast to ``dtype`` (a
    mixed-precision policy's ``param_dtype``): the graph computes with the cast copy, and its gradient flows back
    through the cast to the parameter in the parameter's own dtype (the fp32 master weight). Writes to a parameter's
    ``.data`` keep the parameter itself. A read through a ``GradSum`` is cast after it, so that the ``GradSum`` sees
    the parameter itself and hands its gradient share to the bucket. Returns how many reads were cast; recompiled if
    any."""
    from autotp.rewrite.data_writes import data_of
    from autotp.rewrite.graph_edit import get_tensor

    graph, cast = gm.graph, 0
    for node in list(graph.find_nodes(op="get_attr")):
        value = get_tensor(gm, node.target)
        if not isinstance(value, torch.nn.Parameter) or not value.is_floating_point() or value.dtype == dtype:
            continue
        if only is not None and id(value) not in only:
            continue
        readers = [u for u in node.users if not (u.op == "call_function" and u.target is data_of)]
        sums = [u for u in readers if _is_grad_sum(gm, u)]
        for reader in sums:  # its backward must see the parameter itself, not a cast: cast what it reads out
            _cast_after(graph, reader, dtype)
        plain = [u for u in readers if u not in sums]
        if plain:
            with graph.inserting_after(node):
                copy = graph.call_function(aten._to_copy.default, (node,), {"dtype": dtype})
            for user in plain:
                user.replace_input_with(node, copy)
        cast += bool(readers)
    if cast:
        graph.lint()
        gm.recompile()
    return cast


def _is_grad_sum(gm: fx.GraphModule, node: fx.Node) -> bool:
    """Whether ``node`` calls a ``GradSum`` (a whole parameter read whose gradient share goes to a bucket)."""
    from autotp.rewrite.grad_bucket import GradSum

    return node.op == "call_module" and isinstance(gm.get_submodule(node.target), GradSum)


def _cast_after(graph: fx.Graph, node: fx.Node, dtype: torch.dtype) -> None:
    """Have every reader of ``node`` read its output cast to ``dtype``."""
    with graph.inserting_after(node):
        copy = graph.call_function(aten._to_copy.default, (node,), {"dtype": dtype})
    node.replace_all_uses_with(copy, delete_user_cb=lambda user: user is not copy)


def cast_for_policy(gm: fx.GraphModule, options) -> int:
    """``cast_parameters`` to the mixed-precision policy's ``param_dtype`` of ``options`` (an ``Options``, or None),
    unless FSDP casts the parameters it gathers itself (dp > 1 under fsdp) or the policy sets none."""
    from autotp.options import DataParallelMode

    policy = options.mixed_precision if options is not None else None
    if policy is None or policy.param is None or (options.dp > 1 and options.dp_mode is DataParallelMode.FSDP):
        return 0
    return cast_parameters(gm, policy.param)
