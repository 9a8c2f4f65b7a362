"""In-place writes to values a backward needs, made out of place.

A custom autograd Function's forward may write in place to a value its own ops save for backward (SEW-D's
``XSoftmax``: ``out = softmax(x); out.masked_fill_(mask, 0)``): the Function's hand-written backward never reads
what autograd saved, but torch.export keeps the forward only, and autograd through it then fails (the softmax's
saved output was modified). Written out of place (``masked_fill``, its later readers reading the result), the
graph computes the same values and autograd differentiates it. Only writes to a value an op computed (not an
input, parameter or buffer) that no view shares are rewritten: nothing else can see the difference.

A write through a view that is the whole of a computed value (Chameleon's ``logits[:, :, image_tokens] = min``: full
slices, then ``index_put_``) is a write of that value: written out of place on it (``whole_view_writes``), its
later readers reading the result, the write and its readers keep their order when a rank's graph makes the value
whole for a reader (a gather inserted after the value would read it before the write), and a value a custom
autograd Function returns (a rank's column projection) is never written in place through a view.

Random draws into a fresh value (SEW-D's ``XDropout``: ``empty_like(x).bernoulli_(1 - p)``) are written out of
place always (``out_of_place_draws``): ``bernoulli(x, p)`` draws what ``empty_like(x).bernoulli_(p)`` does (torch
implements it so), and an out-of-place draw that reads only its input's size can be drawn full-size and sliced
where that input is split (``passes.random_ops``), which an in-place write to a split value cannot.
"""

from __future__ import annotations

import torch
from torch import fx

from autotp.passes.graph import arg_or_default, meta_val


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
    return any(_aliased_user(user) for user in node.users)


def _aliased_user(user: fx.Node) -> bool:
    """Whether ``user``'s output shares its input's storage without writing it (a view)."""
    returns = getattr(getattr(user.target, "_schema", None), "returns", ())
    return any(r.alias_info is not None and not r.alias_info.is_write for r in returns)


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
        node.target = twin
        _read_after(node, x, order)
        changed += 1
    if changed:
        gm.graph.lint()
        gm.recompile()
    return changed


def _read_after(write: fx.Node, value: fx.Node, order: dict[fx.Node, int]) -> None:
    """Make the readers of ``value`` after ``write`` (now out of place) read ``write``'s result instead."""
    for user in [u for u in value.users if u is not write and order[u] > order[write]]:
        user.replace_input_with(value, write)


def _full_view_of(node: fx.Node) -> fx.Node | None:
    """The computed value ``node`` views whole (a chain of ``x[:]`` slices, each read only by the next), or None."""
    while node.op == "call_function" and node.target is torch.ops.aten.slice.Tensor:
        source = node.args[0]
        end = arg_or_default(node, 3, "end", None)
        whole = isinstance(source, fx.Node) and arg_or_default(node, 2, "start", None) in (None, 0) \
            and arg_or_default(node, 4, "step", 1) == 1 and (end is None or (
                isinstance(end, int) and end >= meta_val(source).shape[arg_or_default(node, 1, "dim", 0)]))
        if not whole or len(node.users) != 1:
            return None
        node = source
    return node if node.op == "call_function" else None


def whole_view_writes(gm: fx.GraphModule) -> int:
    """Rewrite in-place writes through a whole view of a computed, otherwise unshared value out of place on the
    value (see the module's docstring); returns how many were."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    changed = 0
    for node in list(gm.graph.nodes):
        twin = _out_of_place(node.target) if node.op == "call_function" else None
        view = node.args[0] if node.args else None
        if twin is None or not isinstance(view, fx.Node) or view.target is not torch.ops.aten.slice.Tensor:
            continue
        base = _full_view_of(view)
        if base is None or _aliased_beyond(base, view):
            continue
        node.target, node.args = twin, (base, *node.args[1:])
        _read_after(node, base, order)
        while not view.users and view is not base:  # the slices, read by nothing now
            source = view.args[0]
            gm.graph.erase_node(view)
            view = source
        changed += 1
    if changed:
        gm.graph.lint()
        gm.recompile()
    return changed


def _aliased_beyond(base: fx.Node, view: fx.Node) -> bool:
    """Whether a view of ``base`` other than the chain ending at ``view`` exists."""
    chain = set()
    while view is not base:
        chain.add(view)
        view = view.args[0]
    return any(u not in chain and _aliased_user(u) for u in base.users)

