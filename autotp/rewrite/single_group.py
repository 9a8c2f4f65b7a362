"""A grouped convolution split to one group per rank, kept off torch's dense oneDNN kernel on CPU.

The unsharded model runs a depthwise (grouped) convolution, which torch's CPU backend sends to oneDNN's depthwise
kernel. Split so that each rank holds a single group, the rank's convolution has ``groups=1``: a dense one, which
torch sends to oneDNN's dense kernel instead. That kernel's weight gradient (``jit:avx512_core``
``backward_weights``, torch 2.13's oneDNN) writes out of bounds or never returns when the kernel is large against
its input: Nystromformer's value convolution (kernel 65 over 32 positions, padding 32, one head per rank at tp=4)
aborts the process ("corrupted size vs. prev_size", a segfault) or hangs, in plain torch with no autotp involved.
The unsharded model never reaches that kernel, so its parallel version must not either: the rank computes the
same convolution as im2col and one matrix product (torch's own native algorithm, ``slow_conv2d``; every step's
backward native too). Off the CPU the convolution runs as it was: only torch's CPU backend picks oneDNN.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import fx
from torch.fx.operator_schemas import normalize_function

from autotp.errors import InternalError
from autotp.passes.projections import CONVOLUTIONS

aten = torch.ops.aten
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
    """``x`` (N, C, *spatial) convolved with ``weight`` in one group, as ``F.conv{1,2,3}d`` computes it; on CPU,
    for one or two spatial dims, by im2col and a matrix product instead of oneDNN (the module's docstring)."""
    spatial = weight.dim() - 2
    if x.device.type != "cpu" or spatial == 3:
        return _DENSE[spatial](x, weight, bias, stride, padding, dilation)
    if spatial == 1:  # as a 2-d convolution over (length, 1)
        x, weight = x.unsqueeze(-1), weight.unsqueeze(-1)
        stride, dilation = (*stride, 1), (*dilation, 1)
        padding = padding if isinstance(padding, str) else (*padding, 0)
    x, padding = _explicit(x, weight.shape[2:], padding, dilation)
    out = _im2col_conv2d(x, weight, stride, padding, dilation)
    if bias is not None:
        out = out + bias.view(-1, 1, 1)
    return out.squeeze(-1) if spatial == 1 else out


def _im2col_conv2d(x: torch.Tensor, weight: torch.Tensor, stride: tuple, padding: tuple,
                   dilation: tuple) -> torch.Tensor:
    """A dense 2-d convolution without bias: every window unfolded into a column, times the flattened weight."""
    n, _, height, width = x.shape
    out_channels, _, kh, kw = weight.shape
    columns = F.unfold(x, (kh, kw), dilation=dilation, padding=padding, stride=stride)  # N, C*kh*kw, windows
    rows = [(size + 2 * p - d * (k - 1) - 1) // s + 1
            for size, p, d, k, s in zip((height, width), padding, dilation, (kh, kw), stride)]
    return (weight.reshape(out_channels, -1) @ columns).view(n, out_channels, *rows)


def _explicit(x: torch.Tensor, kernel: tuple, padding: tuple | str, dilation: tuple) -> tuple[torch.Tensor, tuple]:
    """``x`` and numeric padding for ``padding`` (``"valid"``, ``"same"`` or sizes). ``"same"`` pads each dim by
    ``d * (k - 1)`` in all, the odd one at the end, as torch does: symmetric padding where it splits evenly, else
    ``x`` padded explicitly."""
    if not isinstance(padding, str):
        return x, padding
    if padding == "valid":
        return x, (0,) * len(kernel)
    totals = [d * (k - 1) for d, k in zip(dilation, kernel)]
    if all(t % 2 == 0 for t in totals):
        return x, tuple(t // 2 for t in totals)
    pads = [p for t in reversed(totals) for p in (t // 2, t - t // 2)]  # F.pad lists the last dim first
    return F.pad(x, pads), (0,) * len(kernel)


def _each(value, spatial: int) -> tuple:
    """A stride or dilation as one int per spatial dim."""
    return tuple(value) * (spatial if len(value) == 1 else 1) if isinstance(value, (list, tuple)) else (value,) * spatial


def _padding(value, spatial: int):
    """Padding as one int per spatial dim, or its string (``"same"``, ``"valid"``) as given."""
    return value if isinstance(value, str) else _each(value, spatial)
