"""Random ops in a captured graph, and what exactness needs of each under a split.

A random op draws from a generator; for the sharded model to compute exactly what the original does,
every rank must draw what the unsharded op draws (then keep its slice of a split value). That is
possible when the draw depends only on the output's size (a dropout mask, ``rand_like``) or when
every input the draw reads is whole on every rank. This module only classifies; the rewriter
(``autotp.rewrite.random_draws``) does the drawing.
"""

from __future__ import annotations

from enum import Enum

import torch
from autotp.passes.graph import arg_or_default, tensor_args
from autotp.passes.placement import Layout, Shard
from torch import fx

from autotp.torch_private import is_op_overload

aten = torch.ops.aten


class RandomKind(str, Enum):
    """How a random op's draw relates to its inputs."""

    DROPOUT = "dropout"
    """``x * noise``: the noise depends only on x's size (dropout and its native form)."""
    SIZE_ONLY = "size_only"
    """Draws a tensor the size of its first input, whose values it ignores (``rand_like``, ``bernoulli(x, p)``)."""
    WHOLE_INPUTS = "whole_inputs"
    """Reads its inputs' values (``bernoulli(probs)``, ``normal(mean, std)``) or none (``rand(size)``):
    exact only when every input is whole."""
    ATTENTION_DROPOUT = "attention_dropout"
    """``scaled_dot_product_attention`` with ``dropout_p > 0``: the mask is drawn inside the op."""


_BY_OP = {
    aten.dropout.default: RandomKind.DROPOUT,
    aten.dropout_.default: RandomKind.DROPOUT,  # ``nn.Dropout(inplace=True)`` (MobileNet's classifier)
    aten.native_dropout.default: RandomKind.DROPOUT,
    aten.rand_like.default: RandomKind.SIZE_ONLY,
    aten.randn_like.default: RandomKind.SIZE_ONLY,
    aten.randint_like.default: RandomKind.SIZE_ONLY,
    aten.randint_like.low_dtype: RandomKind.SIZE_ONLY,
    aten.bernoulli.p: RandomKind.SIZE_ONLY,
}
SIZE_ONLY_OPS = frozenset(op for op, kind in _BY_OP.items() if kind is RandomKind.SIZE_ONLY)
"""The ops that draw a tensor the size of their first input (when they read no other tensor)."""
_UNSUPPORTED = {aten.feature_dropout.default, aten.alpha_dropout.default, aten.feature_alpha_dropout.default,
                aten.rrelu.default, aten.rrelu_with_noise.default}
"""Random ops autotp does not reproduce under a split (none of them appears in the transformers zoo)."""


def attention_dropout(node: fx.Node) -> float:
    """The ``dropout_p`` of a ``scaled_dot_product_attention`` node (0 for any other node)."""
    if node.target is not aten.scaled_dot_product_attention.default:
        return 0.0
    return float(arg_or_default(node, 4, "dropout_p", 0.0))


def random_kind(node: fx.Node) -> RandomKind | None:
    """How ``node`` draws random numbers, or None when it draws none."""
    if node.op != "call_function":
        return None
    if node.target is aten.scaled_dot_product_attention.default:  # tagged seeded, but draws only with dropout
        return RandomKind.ATTENTION_DROPOUT if attention_dropout(node) > 0 else None
    if node.target in _BY_OP:
        kind = _BY_OP[node.target]
        extra = [a for a in (*node.args[1:], *node.kwargs.values()) if isinstance(a, fx.Node)]
        return RandomKind.WHOLE_INPUTS if kind is RandomKind.SIZE_ONLY and extra else kind
    seeded = is_op_overload(node.target) and torch.Tag.nondeterministic_seeded in node.target.tags
    return RandomKind.WHOLE_INPUTS if seeded else None


def random_refusal(node: fx.Node, layouts: dict[str, Layout]) -> str | None:
    """Why ``node``'s draw cannot be made exact under these layouts (None when it can)."""
    kind = random_kind(node)
    if kind is None:
        return None
    if node.target in _UNSUPPORTED and _split_inputs(node, layouts):
        return f"{node.target} draws per split element in a way autotp does not reproduce"
    if kind is RandomKind.WHOLE_INPUTS and _split_inputs(node, layouts):
        return (f"{node.target} reads the values of an input that is split across ranks, so no rank can draw "
                "what the unsharded op draws")
    return None


def _split_inputs(node: fx.Node, layouts: dict[str, Layout]) -> bool:
    return any(isinstance(layouts.get(n.name), Shard) for _, n in tensor_args(node))
