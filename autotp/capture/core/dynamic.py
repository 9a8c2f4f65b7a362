"""Which input dimensions a capture keeps dynamic.

Token ids, masks and features keep every dimension dynamic (``Dim.AUTO``: torch.export fixes any that the
model's code fixes, such as a position table's length), so a parallel module takes another batch size or
sequence length without capturing again.

An image's height and width are fixed at the example's. A vision model is trained at the size its config
names (a ViT's position table fixes it anyway), and windowed models (Swin: pad to a multiple of the window,
roll, split into windows, four stages each halving the size) make torch.export reason about nested floor
divisions and remainders of symbolic sizes: minutes to capture a two-layer-per-stage Swin, where fixed sizes
take seconds. The batch stays dynamic.
"""

from __future__ import annotations

import torch

from autotp.torch_private import guards_accept, plain_sizes

IMAGE_DIMS = 4
"""A floating-point input with at least this many dimensions is a batch of images or videos
([B, C, H, W], [B, T, C, H, W]): its dimensions after the batch are fixed, but for the sequence ones below."""


def dynamic_dims(x: torch.Tensor, sequence_sizes: frozenset[int]) -> tuple[int, ...]:
    """The dimensions of input ``x`` to capture as dynamic: all of them, but for an image (``IMAGE_DIMS``) only its
    batch and the dimensions whose size is among ``sequence_sizes`` (a float attention mask [B, 1, T, T] stays as
    dynamic as the token ids it masks)."""
    if not (x.is_floating_point() and x.dim() >= IMAGE_DIMS):
        return tuple(range(x.dim()))
    return (0, *(d for d in range(1, x.dim()) if x.shape[d] in sequence_sizes))


def dynamic_shapes(inputs: tuple[torch.Tensor, ...]) -> tuple:
    """``Dim.AUTO`` on each input's ``dynamic_dims``; the capture wrapper takes ``*args``, so the per-input specs
    are nested in one tuple for ``args``. The sequence sizes are those of integer inputs (token ids) after their
    batch."""
    sequence_sizes = _sequence_sizes(inputs)
    return (tuple({d: torch.export.Dim.AUTO for d in dynamic_dims(x, sequence_sizes)} for x in inputs),)


def _sequence_sizes(inputs: tuple[torch.Tensor, ...]) -> frozenset[int]:
    """The sizes of integer inputs (token ids) after their batch."""
    return frozenset(s for x in inputs if not x.is_floating_point() for s in x.shape[1:])


def fixed_dims(gm: torch.fx.GraphModule, inputs: tuple[torch.Tensor, ...]) -> int:
    """How many of the dimensions ``dynamic_shapes`` asked to keep dynamic came out of the capture ``gm`` fixed
    (an int in its placeholder's fake value): torch.export fixed them to the example's size."""
    sequence_sizes = _sequence_sizes(inputs)
    placeholders = gm.graph.find_nodes(op="placeholder")
    # a size torch fixed may still be a SymInt, whose expression is then a number
    return sum(isinstance(plain_sizes(node.meta["val"])[d], int)
               for node, x in zip(placeholders, inputs) if isinstance(node.meta.get("val"), torch.Tensor)
               for d in dynamic_dims(x, sequence_sizes))


def refused_sizes(gm: torch.fx.GraphModule, inputs: tuple[torch.Tensor, ...],
                  sizes: tuple[tuple[int, int, int], ...]) -> int:
    """How many of ``sizes`` (``(input, dim, size)``: the example with that one size changed) the capture ``gm``'s
    input guards refuse; checked on meta tensors, nothing is run."""
    def example_with(i: int, d: int, size: int) -> tuple[torch.Tensor, ...]:
        shapes = [list(x.shape) for x in inputs]
        shapes[i][d] = size
        return tuple(torch.empty(s, dtype=x.dtype, device="meta") for s, x in zip(shapes, inputs))

    return sum(not guards_accept(gm, example_with(*s)) for s in sizes)
