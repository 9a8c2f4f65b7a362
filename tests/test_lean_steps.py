"""The generation steps' operator cuts (rewrite/lean_steps.py) compute what the graph computed, and never merge a
read across an in-place write."""

import torch
from torch import fx, nn

from autotp.rewrite.lean_steps import changing_values, lean_step

aten = torch.ops.aten


class Step(nn.Module):
    """A decode-step shape in miniature: a no-op cast and a whole slice, a table unsqueezed twice, a cache written
    in place."""

    def forward(self, x, table, cache, index):
        x = x.to(torch.float32)[:, :]
        a = x * table.unsqueeze(0)
        cache.index_copy_(0, index, a[:1])
        return a + table.unsqueeze(0), cache.sum(-1)


def _exported():
    example = (torch.randn(3, 4), torch.randn(4), torch.zeros(3, 4), torch.tensor([1]))
    gm = torch.export.export(Step(), example, strict=False).module()
    for node in list(gm.graph.nodes):  # as capture.kv_cache drops export's input guard
        if node.op == "call_module" and not node.users:
            gm.graph.erase_node(node)
    return gm, example


def _calls(gm, target):
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is target]


def test_no_op_calls_and_repeats_are_dropped_and_values_kept():
    gm, example = _exported()
    want = gm(*[t.clone() for t in example])
    assert len(_calls(gm, aten.unsqueeze.default)) == 2 and _calls(gm, aten.to.dtype)
    lean_step(gm, casts_hold=True)
    got = gm(*[t.clone() for t in example])
    assert all(torch.equal(w, g) for w, g in zip(want, got))
    assert len(_calls(gm, aten.unsqueeze.default)) == 1  # the table's two unsqueezes merged
    assert not _calls(gm, aten.to.dtype) and not _calls(gm, aten.alias.default)
    assert not [n for n in _calls(gm, aten.slice.Tensor) if n.args[2:4] == (0, 9223372036854775807)]


def test_casts_stay_when_the_tensors_changed_dtype():
    gm, _ = _exported()
    lean_step(gm, casts_hold=False)
    assert _calls(gm, aten.to.dtype)


def _read_write_read():
    """sum(view(cache)), an in-place write into the view, sum(view(cache)) again: the same call twice, different
    values."""
    graph = fx.Graph()
    cache, index, value = graph.placeholder("cache"), graph.placeholder("index"), graph.placeholder("value")
    reads = []
    for i in range(2):
        view = graph.call_function(aten.slice.Tensor, (cache, 0, 0, 2))
        if i == 1:
            graph.call_function(aten.index_copy_.default, (view, 0, index, value))
        reads.append(graph.call_function(aten.sum.dim_IntList, (cache, [-1])))
    graph.output(tuple(reads))
    return fx.GraphModule(nn.Module(), graph)


def test_reads_around_an_in_place_write_are_not_merged():
    gm = _read_write_read()
    assert {"cache"} <= {n.name for n in changing_values(gm.graph)}
    lean_step(gm, casts_hold=True)
    before, after = gm(torch.zeros(3, 4), torch.tensor([1]), torch.ones(1, 4))
    assert len(_calls(gm, aten.sum.dim_IntList)) == 2
    assert before.sum() == 0 and after.sum() == 4
