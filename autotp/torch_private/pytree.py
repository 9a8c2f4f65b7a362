"""torch's pytree functions (``torch.utils._pytree``: private, and the only pytree torch 2.13 has), looked up when
called: nested outputs flattened and rebuilt as torch.export flattens them."""

from __future__ import annotations

from autotp.torch_private.entries import constant

constant("pytree", "torch.utils._pytree's tree_flatten, tree_unflatten, tree_leaves, tree_map, tree_map_only")


def tree_flatten(tree, *args, **kwargs):
    """``torch.utils._pytree.tree_flatten``: the leaves of ``tree`` and its spec."""
    from torch.utils import _pytree

    return _pytree.tree_flatten(tree, *args, **kwargs)


def tree_unflatten(leaves, spec):
    """``torch.utils._pytree.tree_unflatten``: the tree of ``spec`` holding ``leaves``."""
    from torch.utils import _pytree

    return _pytree.tree_unflatten(leaves, spec)


def tree_leaves(tree, *args, **kwargs):
    """``torch.utils._pytree.tree_leaves``: the leaves of ``tree``, in order."""
    from torch.utils import _pytree

    return _pytree.tree_leaves(tree, *args, **kwargs)


def tree_map(function, tree, *args, **kwargs):
    """``torch.utils._pytree.tree_map``: ``tree`` with ``function`` applied to each leaf."""
    from torch.utils import _pytree

    return _pytree.tree_map(function, tree, *args, **kwargs)


def tree_map_only(kind, function, tree, *args, **kwargs):
    """``torch.utils._pytree.tree_map_only``: ``tree`` with ``function`` applied to each leaf of type ``kind``."""
    from torch.utils import _pytree

    return _pytree.tree_map_only(kind, function, tree, *args, **kwargs)
