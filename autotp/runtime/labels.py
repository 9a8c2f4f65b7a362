"""An evaluation forward without ``labels`` on a module captured with them.

A graph is fixed at capture: a model captured with ``labels`` takes them on every call. Evaluation code calls
``model(input_ids)`` and reads the logits; the original model then returns no loss. When the graph shows that the
labels feed the loss alone (no other output depends on them: a decoder that shifts labels into its decoder inputs
is excluded), the forward runs on stand-in labels and the loss is dropped from the output, so the outputs are
the ones the original model gives without labels. Otherwise the labels stay required.
"""

from __future__ import annotations

import torch
from torch import fx
from autotp.torch_private.pytree import tree_unflatten

from autotp.runtime.loss import model_loss

LABELS = "labels"


def _dependents(start: fx.Node) -> set[fx.Node]:
    """Every tensor computed from ``start``'s values. Sizes are not followed: a sequence length read off the
    labels (export reads a shared size from any input having it) is the same for stand-in labels."""
    seen, todo = set(), [start]
    while todo:
        for user in todo.pop().users:
            if user not in seen and isinstance(user.meta.get("val"), torch.Tensor):
                seen.add(user)
                todo.append(user)
    return seen


def labels_feed_loss_only(graph: fx.Graph, input_names: tuple[str, ...], out_spec) -> bool:
    """Whether the graph's ``labels`` input reaches its output only through the model's ``loss`` entry."""
    if LABELS not in input_names:
        return False
    placeholders = list(graph.find_nodes(op="placeholder"))
    labels = placeholders[input_names.index(LABELS)]
    output = next(iter(graph.find_nodes(op="output")))
    leaves = list(output.args[0]) if isinstance(output.args[0], (tuple, list)) else [output.args[0]]
    try:
        rebuilt = tree_unflatten(list(range(len(leaves))), out_spec)
    except Exception:  # an output type that cannot be rebuilt from placeholders: keep labels required
        return False
    loss = model_loss(rebuilt)
    if not isinstance(loss, int):
        return False
    reached = _dependents(labels)
    return all(i == loss or leaf not in reached for i, leaf in enumerate(leaves) if isinstance(leaf, fx.Node))


def stand_in(sizes: tuple[str, ...], dtype: torch.dtype, named: dict, captured_sizes: dict[str, tuple[str, ...]]):
    """Labels of a shape the loss accepts, zeros (a valid class everywhere, so the dropped loss is finite), or None
    when the call has no tensor. A dim captured static keeps its size; a dynamic one takes the size of a given input
    captured with the same symbol, else of the same dim of the first input with that many dims (export gives
    labels sizes of their own: a language model's labels are shaped as its ids, a classifier's as their batch)."""
    given = [(name, x) for name, x in named.items() if isinstance(x, torch.Tensor)]
    if not given:
        return None
    like = next((x for _, x in given if x.dim() >= len(sizes)), given[0][1])
    shape = []
    for d, symbol in enumerate(sizes):
        shared = (x.shape[i] for name, x in given for i, s in enumerate(captured_sizes.get(name, ()))
                  if s == symbol and i < x.dim())
        size = int(symbol) if symbol.isdigit() else next(shared, like.shape[d] if d < like.dim() else None)
        if size is None:
            return None
        shape.append(size)
    return torch.zeros(shape, dtype=dtype, device=like.device)
