"""In-place writes to values a backward needs, made out of place.

A custom autograd Function's forward may write in place to a value its own ops save for backward (SEW-D's
``XSoftmax``: ``out = softmax(x); out.masked_fill_(mask, 0)``): the Function's hand-written backward never reads
what autograd saved, but torch.export keeps the forward only, and autograd through it then fails (the softmax's
saved output was modified). Written out of place (``masked_fill``, its later readers reading the result), the
graph computes the same values and autograd differentiates it. Only writes to a value an op computed (not an
input, parameter or buffer) that no view shares are rewritten: nothing else can see the difference.

Random draws into a fresh value (SEW-D's ``XDropout``: ``empty_like(x).bernoulli_(1 - p)``) are written out of
place always (``out_of_place_draws``): ``bernoulli(x, p)`` draws what ``empty_like(x).bernoulli_(p)`` does (torch
implements it so), and an out-of-place draw that reads only its input's size can be drawn full-size and sliced
where that input is split (``passes.random_ops``), which an in-place write to a split value cannot.
"""

from __future__ import annotations

import torch
from torch import fx


_TWINS = {torch.ops.aten.bernoulli_.float: torch.ops.aten.bernoulli.p}
"""In-place ops whose out-of-place overload is named otherwise."""


def _out_of_place(target):
    """The out-of-place overload of an in-place aten op (``masked_fill_.Scalar`` -> ``masked_fill.Scalar``), or
    None."""
    if target in _TWINS:
        return _TWINS[target]
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


def _draw(node: fx.Node) -> bool:
    """Whether ``node`` is an in-place random draw (``bernoulli_``, ``uniform_``)."""
    tags = getattr(node.target, "tags", ())
    return torch.Tag.inplace in tags and torch.Tag.nondeterministic_seeded in tags


def out_of_place_draws(gm: fx.GraphModule) -> int:
    """Rewrite in-place random draws into computed, unshared values of ``gm`` out of place (see the module's
    docstring); returns how many were."""
    return out_of_place_writes(gm, _draw)


def out_of_place_writes(gm: fx.GraphModule, which=lambda node: True) -> int:
    """Rewrite in place writes to computed, unshared values of ``gm`` out of place (those ``which(node)`` picks;
    see the module's docstring); returns how many were."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    changed = 0
    for node in list(gm.graph.nodes):
        twin = _out_of_place(node.target) if node.op == "call_function" and which(node) else None
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
