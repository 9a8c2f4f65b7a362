"""A grouped convolution split to one group per rank, kept off torch's dense oneDNN kernel on CPU.

The unsharded model runs a depthwise (grouped) convolution, which torch's CPU backend sends to oneDNN's depthwise
kernel. Split so that each rank holds a single group, the rank's convolution has ``groups=1``: a dense one, which
torch sends to oneDNN's dense kernel instead. That kernel's weight gradient (``jit:avx512_core``
``backward_weights``, torch 2.13's oneDNN) writes out of bounds or never returns when the kernel is large against
its input: Nystromformer's value convolution (kernel 65 over 32 positions, padding 32, one head per rank at tp=4)
aborts the process ("corrupted size vs. prev_size", a segfault) or hangs, in plain torch with no autotp involved.
The unsharded model never reaches that kernel, so its parallel version must not either: the rank computes the
same convolution as im2col and a matrix product: torch's own native ``slow_conv2d`` (whose backward is native
too), or, dilated or over three dims, slices, a stack and a matmul. Off the CPU the convolution runs as it was: only
torch's CPU backend picks oneDNN.
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
from torch import fx
from torch.fx.operator_schemas import normalize_function

from autotp.errors import InternalError
from autotp.passes.projections import CONVOLUTIONS

_DENSE = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}


def route_single_group(node: fx.Node) -> None:
    """Make ``node``, a rank's convolution whose groups the split made 1, run ``single_group_conv``."""
    if node.target not in CONVOLUTIONS:
        raise InternalError(f"{node.name} ({node.target}) is not a convolution, yet its groups were fixed to 1")
    normal = normalize_function(node.target, node.args, node.kwargs, normalize_to_only_use_kwargs=True)
    if normal is None:
        raise InternalError(f"cannot read the arguments of convolution {node.name} ({node.target})")
    kw = normal.kwargs
    if kw.get("transposed", False):
        raise InternalError(f"transposed convolution {node.name} was split by groups")
    spatial = len(node.args[1].meta["val"].shape) - 2
    args = (kw["input"], kw["weight"], kw.get("bias"), _each(kw.get("stride", 1), spatial),
            _padding(kw.get("padding", 0), spatial), _each(kw.get("dilation", 1), spatial))
    node.target, node.args, node.kwargs = single_group_conv, args, {}


def single_group_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, stride: tuple,
                      padding: tuple | str, dilation: tuple) -> torch.Tensor:
    """``x`` (N, C, *spatial) convolved with ``weight`` in one group, as ``F.conv{1,2,3}d`` computes it; on CPU by
    im2col and a matrix product instead of oneDNN (the module's docstring)."""
    spatial = weight.dim() - 2
    if x.device.type != "cpu":
        return _DENSE[spatial](x, weight, bias, stride, padding, dilation)
    pads = _pads(weight.shape[2:], padding, dilation)
    if any(before != after for before, after in pads):  # padded explicitly, as torch pads an odd "same"
        x, pads = F.pad(x, [p for pair in reversed(pads) for p in pair]), [(0, 0)] * spatial  # last dim first
    padding = tuple(before for before, _ in pads)
    if spatial == 3 or any(d != 1 for d in dilation):
        return _windows_conv(x, weight, bias, stride, padding, dilation)
    if spatial == 1:  # as a 2-d convolution over (length, 1)
        return _native_conv2d(x.unsqueeze(-1), weight.unsqueeze(-1), bias, (*stride, 1), (*padding, 0)).squeeze(-1)
    return _native_conv2d(x, weight, bias, stride, padding)


def _native_conv2d(x, weight, bias, stride, padding) -> torch.Tensor:
    """torch's own CPU im2col convolution (what it runs for a small batch of one), backward included."""
    return torch.ops.aten._slow_conv2d_forward(x.contiguous(), weight.contiguous(), weight.shape[2:], bias, stride,
                                               padding)


def _windows_conv(x, weight, bias, stride, padding, dilation) -> torch.Tensor:
    """A dilated or 3-d convolution (no native CPU kernel whose backward avoids oneDNN): every kernel tap's window
    of ``x`` sliced, stacked into columns, times the flattened weight."""
    kernel, spatial = weight.shape[2:], weight.dim() - 2
    x = F.pad(x, [p for p in reversed(padding) for _ in range(2)])  # last dim first
    sizes = [(size - d * (k - 1) - 1) // s + 1 for size, d, k, s in zip(x.shape[2:], dilation, kernel, stride)]
    windows = [x[(..., *(slice(o * d, o * d + s * (n - 1) + 1, s)
                         for o, d, s, n in zip(offset, dilation, stride, sizes)))]
               for offset in itertools.product(*map(range, kernel))]  # the weight's order of kernel taps
    columns = torch.stack(windows, dim=2).flatten(1, 2).flatten(2)  # N, C * taps, positions
    out = (weight.flatten(1) @ columns).view(x.shape[0], weight.shape[0], *sizes)
    return out if bias is None else out + bias.view(-1, *(1,) * spatial)


def _pads(kernel: tuple, padding: tuple | str, dilation: tuple) -> list[tuple[int, int]]:
    """(before, after) padding of each spatial dim for ``padding`` (sizes, ``"valid"`` or ``"same"``); ``"same"``
    pads each dim by ``d * (k - 1)`` in all, the odd one at the end, as torch does."""
    if padding == "valid":
        return [(0, 0)] * len(kernel)
    if padding == "same":
        return [(d * (k - 1) // 2, d * (k - 1) - d * (k - 1) // 2) for d, k in zip(dilation, kernel)]
    return [(p, p) for p in padding]


def _each(value, spatial: int) -> tuple:
    """A stride or dilation as one int per spatial dim."""
    if not isinstance(value, (list, tuple)):
        return (value,) * spatial
    return tuple(value) * (spatial if len(value) == 1 else 1)


def _padding(value, spatial: int):
    """Padding as one int per spatial dim, or its string (``"same"``, ``"valid"``) as given."""
    return value if isinstance(value, str) else _each(value, spatial)
