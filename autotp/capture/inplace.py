"""In-place writes to values a backward needs, made out of place.

A custom autograd Function's forward may write in place to a value its own ops save for backward (SEW-D's
``XSoftmax``: ``out = softmax(x); out.masked_fill_(mask, 0)``): the Function's hand-written backward never reads
what autograd saved, but torch.export keeps the forward only, and autograd through it then fails (the softmax's
saved output was modified). Written out of place (``masked_fill``, its later readers reading the result), the
graph computes the same values and autograd differentiates it. Only writes to a value an op computed (not an
input, parameter or buffer) that no view shares are rewritten: nothing else can see the difference.
"""

from __future__ import annotations

import torch
from torch import fx


def _out_of_place(target):
    """The out-of-place overload of an in-place aten op (``masked_fill_.Scalar`` -> ``masked_fill.Scalar``), or
    None."""
    packet = getattr(target, "overloadpacket", None)
    name = getattr(packet, "__name__", "")
    if not name.endswith("_") or name.startswith("_"):
        return None
    twin = getattr(torch.ops.aten, name[:-1], None)
    return getattr(twin, target._overloadname, None) if twin is not None else None


def _aliased(node: fx.Node) -> bool:
    """Whether a view of ``node``'s value exists: a reader whose output shares its storage without writing it."""
    for user in node.users:
        returns = getattr(getattr(user.target, "_schema", None), "returns", ())
        if any(r.alias_info is not None and not r.alias_info.is_write for r in returns):
            return True
    return False


def out_of_place_writes(gm: fx.GraphModule) -> int:
    """Rewrite in place writes to computed, unshared values of ``gm`` out of place (see the module's docstring);
    returns how many were."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    changed = 0
    for node in list(gm.graph.nodes):
        twin = _out_of_place(node.target) if node.op == "call_function" else None
        x = node.args[0] if node.args else None
        if twin is None or not isinstance(x, fx.Node) or x.op != "call_function" or _aliased(x):
            continue
        later = [u for u in x.users if u is not node and order[u] > order[node]]
        node.target = twin
        for user in later:
            user.replace_input_with(x, node)
        changed += 1
    if changed:
        gm.graph.lint()
        gm.recompile()
    return changed
