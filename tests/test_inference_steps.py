"""The generation steps' inference-only forms (rewrite/inference_steps.py) compute what the graph computed: the
tensor-parallel modules without their autograd functions, linear on oneDNN, grouped-query attention unrepeated."""

import torch
from torch import fx, nn
from torch.nn import functional as F

from autotp.rewrite.collectives import CopyToTP, ReduceFromTP
from autotp.rewrite.columns import OverlappedColumnLinear
from autotp.rewrite.inference_steps import AllReduce, _repeats_heads, grouped_attention, inference_step, linear

aten = torch.ops.aten


class Doubling:
    """A communicator of two ranks holding the same value."""

    rank, size, pending = 0, 2, None

    def all_reduce(self, x):
        return x + x


class Attention(nn.Module):
    """Grouped-query attention as transformers writes it: 2 K/V heads repeated for 4 query heads."""

    def forward(self, x, weight, keys, values, mask):
        q = F.linear(x, weight).view(3, 1, 4, 8).transpose(1, 2)
        keys = keys.unsqueeze(2).expand(3, 2, 2, 5, 8).reshape(3, 4, 5, 8)
        values = values.unsqueeze(2).expand(3, 2, 2, 5, 8).reshape(3, 4, 5, 8)
        return F.scaled_dot_product_attention(q, keys, values, mask, scale=0.5)


def _calls(gm, target):
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is target]


def test_grouped_attention_reads_the_heads_unrepeated_and_linear_runs_on_onednn():
    g = torch.Generator().manual_seed(0)
    mask = torch.rand(3, 1, 1, 5, generator=g) > 0.3
    mask[..., 0] = True
    example = (torch.randn(3, 1, 16, generator=g), torch.randn(32, 16, generator=g), torch.randn(3, 2, 5, 8, generator=g),
               torch.randn(3, 2, 5, 8, generator=g), mask)
    gm = torch.export.export(Attention(), example, strict=False).module()
    with torch.inference_mode():
        want = gm(*example)
        inference_step(gm)
        got = gm(*example)
    assert len(_calls(gm, grouped_attention)) == 1 and len(_calls(gm, linear)) == 1
    assert not _calls(gm, aten.expand.default) and not _calls(gm, aten.scaled_dot_product_attention.default)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)  # the product's rounding; the attention's own bits


def test_heads_repeat_only_along_the_new_dimension():
    kv = torch.zeros(3, 2, 5, 8)
    assert _repeats_heads(kv, [3, 2, 4, 5, 8], [3, 8, 5, 8]) and _repeats_heads(kv, [-1, -1, 4, -1, -1], [3, -1, 5, 8])
    assert not _repeats_heads(kv, [3, 2, 4, 5, 8], [3, 2, 20, 8])  # merged into the positions, not the heads
    assert not _repeats_heads(torch.zeros(1, 2, 5, 8), [3, 2, 4, 5, 8], [3, 8, 5, 8])  # the batch broadcast too
    q, k, v = torch.randn(3, 8, 1, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)
    sizes = ([3, 2, 4, 5, 8], [3, 8, 5, 8])
    rep = k.unsqueeze(2).expand(*sizes[0]).reshape(sizes[1]), v.unsqueeze(2).expand(*sizes[0]).reshape(sizes[1])
    assert torch.equal(grouped_attention(q, k, v, sizes, sizes), F.scaled_dot_product_attention(q, *rep))
    k, v = torch.randn(3, 2, 5, 8), torch.randn(3, 2, 5, 8)
    rep = k.unsqueeze(2).expand(*sizes[0]).reshape(sizes[1]), v.unsqueeze(2).expand(*sizes[0]).reshape(sizes[1])
    with torch.profiler.profile() as prof:
        got = grouped_attention(q, k, v, sizes, sizes)
    assert "aten::expand" not in {e.name for e in prof.events()}  # the heads were not repeated
    assert torch.equal(got, F.scaled_dot_product_attention(q, *rep))


def test_tensor_parallel_modules_lose_their_autograd_functions_and_tensors_are_read_directly():
    root = nn.Module()
    comm = Doubling()
    root.f, root.g, root.column = CopyToTP(comm), ReduceFromTP(comm), OverlappedColumnLinear(comm)
    root.inner = nn.Linear(4, 6, bias=False)
    graph = fx.Graph()
    x = graph.placeholder("x")
    y = graph.call_module("column", (graph.call_module("f", (x,)), graph.get_attr("inner.weight")))
    graph.output(graph.call_module("g", (y,)))
    gm = fx.GraphModule(root, graph)
    x = torch.randn(2, 4)
    with torch.inference_mode():
        want = gm(x)
        inference_step(gm)
        got = gm(x)
    assert [n.target for n in gm.graph.nodes if n.op == "call_module"] == ["g"] and type(gm.g) is AllReduce
    assert len(_calls(gm, linear)) == 1
    read = [n.target for n in gm.graph.nodes if n.op == "get_attr"]
    assert len(read) == 1 and "." not in read[0] and getattr(gm, read[0]) is root.inner.weight  # no copy
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
