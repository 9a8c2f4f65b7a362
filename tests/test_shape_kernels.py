"""The shape-only kernels the capture traces with (``autotp.capture.speedups.shape_kernels``): the graph torch.export makes
with them is node for node and meta for meta the one it makes without (sizes, strides, dtypes, gradient flags);
shapes they do not cover go to torch's kernels; the process is left as it was found; and autotp's own stand-in is
not taken for a user's autograd Function."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch._C import DispatchKey
from torch._subclasses import fake_impls

from autotp.capture import capture
from autotp.capture.speedups.shape_kernels import (STAND_INS, _SizedLike, attention_size, linear_size, matmul_size,
                                                   shape_only_kernels)
from autotp.torch_private import no_symbolic_layout_probes
from autotp.errors import InternalError
from bench.shape_kernels import signature
from tests.test_capture_dynamic import _Windowed


class _EveryStandIn(nn.Module):
    """Each stand-in in the cases it covers and the ones it hands to torch: a linear of a 4-d input, layer norms of
    contiguous and strided inputs, batched matmuls (same and broadcast batch dims), attention on the math path (a
    mask that needs a gradient) and on the fused one (no mask), views that split and merge dims of contiguous and
    strided inputs."""

    def __init__(self, dim=16, heads=2):
        super().__init__()
        self.qkv, self.out = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.norm = nn.LayerNorm(dim)
        self.bias = nn.Parameter(torch.randn(heads, 4, 4))
        self.mix = nn.Parameter(torch.randn(heads, dim // heads, dim // heads))  # broadcast and 2-d: torch's
        self.heads = heads

    def forward(self, x):  # [B, 2, 4, dim]
        b, h, t, d = x.shape
        q, k, v = self.qkv(self.norm(x)).view(b * h, t, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        masked = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=self.bias)  # math path
        fused = nn.functional.scaled_dot_product_attention(q, k, v)  # the fused CPU kernel: torch's
        scores = (q @ k.transpose(-2, -1)).softmax(-1) @ v + q @ self.mix.unsqueeze(0) + q @ self.mix[0]
        mixed = (masked + fused + scores).transpose(1, 2)
        strided = self.norm(mixed.reshape(b * h, t, d).transpose(0, 1)).transpose(0, 1)  # a strided layer norm
        viewed = x.transpose(2, 3).view(b * h, d, t).transpose(1, 2).view(b, h, t, d)  # strided, then contiguous
        pooled = self.norm(x.permute(0, 3, 1, 2).mean((2, 3), keepdim=True).permute(0, 2, 3, 1))  # size-1 dims
        return self.out(strided.contiguous().view(b, h, t, -1)) + viewed + pooled


def _exported(model: nn.Module, inputs: tuple, stand_ins: bool) -> torch.fx.GraphModule:
    model.train()
    batch = ({0: torch.export.Dim.AUTO},)
    if stand_ins:
        with shape_only_kernels():
            return torch.export.export(model, inputs, strict=False, dynamic_shapes=batch).module()
    return torch.export.export(model, inputs, strict=False, dynamic_shapes=batch).module()


@pytest.mark.parametrize("model, inputs", [
    (_EveryStandIn(), (torch.randn(2, 2, 4, 16),)),
    (_Windowed(), (torch.randn(2, 3, 16, 16),)),
    (_Windowed(cosine=True), (torch.randn(2, 3, 16, 16),)),
], ids=["every-stand-in", "windowed", "windowed-cosine"])
def test_the_graph_and_every_meta_are_what_torch_makes_without_them(model, inputs):
    torch.manual_seed(0)
    plain, quick = _exported(model, inputs, False), _exported(model, inputs, True)
    assert signature(quick) == signature(plain)
    assert torch.equal(quick(*inputs), model(*inputs))


def test_a_hugging_face_swin_captures_the_same_graph():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.SwinConfig(image_size=32, patch_size=4, embed_dim=16, depths=[2, 2], num_heads=[2, 4],
                                     window_size=2, num_labels=3)
    model = transformers.SwinForImageClassification(config)
    inputs = (torch.randn(2, 3, 32, 32),)
    assert signature(_exported(model, inputs, True)) == signature(_exported(model, inputs, False))


def test_the_process_is_left_as_it_was_found_even_when_the_trace_fails():
    before = ({op: op.py_kernels.get(DispatchKey.CompositeImplicitAutograd) for op in STAND_INS},
              fake_impls.op_implementations_dict[torch.ops.aten.view.default])
    with pytest.raises(RuntimeError, match="stop"), shape_only_kernels():
        with shape_only_kernels():  # nested: the outer one's stand-ins stay
            assert STAND_INS[torch.ops.aten.linear.default] is torch.ops.aten.linear.default.py_kernels[
                DispatchKey.CompositeImplicitAutograd]
        raise RuntimeError("stop")
    after = ({op: op.py_kernels.get(DispatchKey.CompositeImplicitAutograd) for op in STAND_INS},
             fake_impls.op_implementations_dict[torch.ops.aten.view.default])
    assert after == before
    assert before[0][torch.ops.aten.matmul.default] is not None  # torch's own Python kernel, put back


def test_only_symbolic_outputs_go_without_a_memory_format_and_torch_s_probe_is_put_back():
    from torch.fx.experimental import proxy_tensor
    torch_s = proxy_tensor._extract_tensor_metadata
    model, inputs = nn.Sequential(nn.Linear(8, 8), nn.ReLU()), (torch.randn(2, 8),)
    with pytest.raises(RuntimeError, match="stop"), no_symbolic_layout_probes():
        gm = torch.export.export(model, inputs, strict=False, dynamic_shapes=({0: torch.export.Dim.AUTO},)).module()
        static = torch.export.export(model, inputs, strict=False).module()
        raise RuntimeError("stop")
    assert proxy_tensor._extract_tensor_metadata is torch_s
    def symbolic(node):
        return any(isinstance(d, torch.SymInt) for d in node.meta["val"].shape)

    metas = [(symbolic(n), n.meta["tensor_meta"].memory_format) for n in gm.graph.nodes if "tensor_meta" in n.meta]
    assert {f for is_symbolic, f in metas if is_symbolic} == {None}
    assert {f for is_symbolic, f in metas if not is_symbolic} == {torch.contiguous_format}  # the weights
    static_formats = [n.meta["tensor_meta"].memory_format for n in static.graph.nodes if "tensor_meta" in n.meta]
    assert static_formats and set(static_formats) == {torch.contiguous_format}  # torch's own answer


def test_shapes_they_do_not_cover_go_to_torch():
    x, w = torch.empty(2, 3, 8), torch.empty(4, 8)
    assert linear_size(x, w) == (2, 3, 4) and linear_size(x, torch.empty(4, 5)) is None
    assert linear_size(torch.empty(8), w) is None  # a vector: torch's
    assert matmul_size(torch.empty(2, 3, 4), torch.empty(2, 4, 5)) == (2, 3, 5)
    assert matmul_size(torch.empty(2, 3, 4), torch.empty(1, 4, 5)) is None  # broadcast batch dims: torch's
    assert matmul_size(torch.empty(3, 4), torch.empty(2, 4, 5)) is None
    q, kv = torch.empty(2, 4, 6, 8), torch.empty(2, 2, 7, 8)
    assert attention_size(q, kv, kv) is None and attention_size(q, kv, kv, enable_gqa=True) == (2, 4, 6, 8)


def test_the_stand_in_is_not_a_user_function_and_refuses_a_backward():
    cap = capture(_EveryStandIn(), (torch.randn(2, 2, 4, 16),))
    assert cap.custom_functions == ()  # else the capture would replay gradients for autotp's own stand-in
    x = torch.randn(3, requires_grad=True)
    with pytest.raises(InternalError, match="shape-only stand-in was differentiated"):
        _SizedLike.apply((3,), (1,), x, x).sum().backward()


def _symbolic(*sizes, dynamic=(0,)):
    """A fake tensor of ``sizes`` whose dims in ``dynamic`` are symbolic, and its mode."""
    from torch._dynamo.source import ConstantSource
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

    mode = FakeTensorMode(shape_env=ShapeEnv())
    kinds = [DimDynamic.DYNAMIC if d in dynamic else DimDynamic.STATIC for d in range(len(sizes))]
    return mode, mode.from_tensor(torch.empty(sizes), source=ConstantSource("x"),
                                  symbolic_context=StatelessSymbolicContext(dynamic_sizes=kinds))


@pytest.mark.parametrize("sizes, dynamic, make_view", [
    ((2, 16, 64), (0, 1), lambda x: (-1, 64)),  # merges two symbolic dims (torch writes Min strides)
    ((2, 16, 64), (0, 1), lambda x: (x.shape[0], x.shape[1], 4, -1)),  # splits the last
    ((2, 8, 8, 32), (0,), lambda x: (x.shape[0], 4, 2, 4, 2, 32)),  # a window partition
    ((2, 16, 64), (0, 1), lambda x: (x.shape[0], x.shape[1], 64, 1)),  # a trailing 1
    ((8, 4, 3), (0,), lambda x: (2, -1, 12)),  # regroups a symbolic leading dim
], ids=["merge", "split", "windows", "trailing-1", "regroup"])
def test_a_view_s_sizes_and_strides_are_torch_s(sizes, dynamic, make_view):
    from autotp.capture.speedups.view_layout import view_layout

    mode, x = _symbolic(*sizes, dynamic=dynamic)
    with mode:
        for a in (x, x.transpose(-1, -2).contiguous().transpose(-1, -2)):  # contiguous, then strided
            shape = make_view(a)
            layout = view_layout(a, shape)
            try:
                want = a.view(shape)
            except (RuntimeError, ValueError):  # no such view: torch's kernel raises it, the stand-in hands it over
                assert layout is None
                continue
            assert layout is not None
            assert tuple(map(str, layout[0])) == tuple(map(str, want.shape))
            assert tuple(map(str, layout[1])) == tuple(map(str, want.stride()))


def test_an_inferred_size_is_the_exact_quotient_or_torch_s():
    from autotp.capture.speedups.view_layout import _exact_quotient

    mode, x = _symbolic(2, 16, 64, dynamic=(0, 1))
    b, t = x.shape[0], x.shape[1]
    assert str(_exact_quotient(x.numel(), t * 64)) == str(b)
    assert str(_exact_quotient(x.numel(), 4 * b * t)) == "16"
    assert _exact_quotient(x.numel(), 3 * t) is None  # not a whole multiple: torch's floor division decides
    assert _exact_quotient(96, 4) is None  # plain ints: torch's
