"""The tensor-parallel rewriter on tiny graphs: slices, fixed constants, inserted collectives, one process.

The reductions are swapped for identities here, so each rank's module returns its partial sum; the
ranks' outputs then add up to the original model's (the real all-reduce is tested on gloo ranks).
"""

from __future__ import annotations

import torch
from autotp.passes.placement import local_shard
from torch import nn
from torch.testing import assert_close

from autotp.options import Options
from autotp.planning import make_plan
from autotp.rewrite import rewrite
from autotp.rewrite.collectives import CopyToTP, ReduceFromTP
from autotp.rewrite.columns import OverlappedColumnLinear
from tests.graphs import MLP, Heads, captured

aten = torch.ops.aten


def _ranks(model, x, tp=2):
    cap = captured(model, x)
    plan = make_plan(cap, Options(tp=tp))
    return cap, plan, [rewrite(cap, plan, rank, comm=None) for rank in range(tp)]


def _partial(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """``gm`` with every reduction replaced by the identity (this rank's partial sum comes out)."""
    for name, module in list(gm.named_children()):
        if isinstance(module, ReduceFromTP):
            setattr(gm, name, nn.Identity())
    return gm


def test_mlp_ranks_hold_their_slices_and_sum_to_the_original():
    torch.manual_seed(0)
    model, x = MLP(), torch.randn(2, 3, 8)
    _, _, ranks = _ranks(model, x)
    for rank, gm in enumerate(ranks):
        params = dict(gm.named_parameters())
        assert_close(params["model.up.weight"], local_shard(model.up.weight.detach(), 0, (16,), rank, 2))
        assert_close(params["model.down.weight"], local_shard(model.down.weight.detach(), 1, (16,), rank, 2))
    total = sum(_partial(gm)(x) for gm in ranks)
    assert_close(total, model(x))


class TwoReaders(nn.Module):
    """Two column projections reading one input (gate and up), closed by one row."""

    def __init__(self):
        super().__init__()
        self.gate, self.up, self.down = nn.Linear(8, 16, bias=False), nn.Linear(8, 16, bias=False), nn.Linear(16, 8)

    def forward(self, x):
        return self.down(torch.relu(self.gate(x)) * self.up(x))


class Written(nn.Module):
    """Projections written as ``x @ W.t()`` (as megatron-core's layers trace)."""

    def __init__(self):
        super().__init__()
        self.w_up, self.w_down = nn.Parameter(torch.randn(16, 8) * 0.1), nn.Parameter(torch.randn(8, 16) * 0.1)

    def forward(self, x):
        return torch.relu(x @ self.w_up.t()) @ self.w_down.t()


def _kinds(gm) -> list[type]:
    return [type(m) for _, m in gm.named_children() if m.__class__.__module__.startswith("autotp")]


def test_collectives_are_inserted_as_megatrons_f_and_g():
    """``f`` before the column projections (fused into the one projection that alone reads through it, which
    overlaps its gradient all-reduce with the weight gradient), ``g`` after the row."""
    for model in (MLP(), Written()):
        _, _, (gm, _) = _ranks(model, torch.randn(2, 3, 8))
        assert _kinds(gm).count(OverlappedColumnLinear) == 1 and _kinds(gm).count(ReduceFromTP) == 1
        assert CopyToTP not in _kinds(gm)
    _, _, (gm, _) = _ranks(TwoReaders(), torch.randn(2, 3, 8))
    assert _kinds(gm).count(CopyToTP) == 1 and OverlappedColumnLinear not in _kinds(gm)  # one f for both
    order = [n.target for n in gm.graph.nodes if n.op in ("call_module", "call_function")]
    f_at = next(i for i, n in enumerate(gm.graph.nodes) if n.op == "call_module" and "copytotp" in n.target)
    linear_at = next(i for i, n in enumerate(gm.graph.nodes) if n.target is aten.linear.default)
    assert f_at < linear_at, order


def test_overlapped_columns_train_exactly():
    import autotp

    for model in (MLP(bias=True), Written(), TwoReaders()):
        report = autotp.check(model, 2, torch.randn(2, 3, 8))
        assert report.exact, f"{type(model).__name__}: {report}"


def test_an_overlapped_column_takes_the_gradient_of_no_rows():
    """A projection of no rows (an expert no token was routed to) has an empty gradient of the input's shape."""

    class Alone:  # one rank: the all-reduce is the identity
        def all_reduce_started(self, x):
            return lambda: x

    x = torch.zeros(0, 8, requires_grad=True)
    weight = torch.randn(6, 8, requires_grad=True)
    OverlappedColumnLinear(Alone())(x, weight).sum().backward()
    assert x.grad.shape == (0, 8) and torch.equal(weight.grad, torch.zeros(6, 8))


def test_row_bias_is_added_once_after_the_reduction():
    torch.manual_seed(0)
    model, x = MLP(bias=True), torch.randn(2, 3, 8)
    _, _, ranks = _ranks(model, x)
    gm = ranks[0]
    reduce = next(n for n in gm.graph.nodes if n.op == "call_module" and "reducefromtp" in n.target)
    (user,) = reduce.users
    assert user.target is aten.add.Tensor and user.args[1].target == "model.down.bias"
    # Partial sums without the bias, plus the bias once, give the original output.
    total = sum(_partial(g)(x) for g in ranks) - model.down.bias
    assert_close(total, model(x))


def test_head_counts_are_fixed_in_the_rank_graph():
    torch.manual_seed(0)
    model, x = Heads(dim=16, heads=4), torch.randn(2, 3, 16)
    _, plan, ranks = _ranks(model, x)
    assert plan.placements["qkv.weight"].segments == (16, 16, 16)
    views = [n for n in ranks[0].graph.nodes if n.target is aten.view.default]
    assert views and all(n.args[1][2] == 2 for n in views)  # 4 heads -> 2 per rank
    assert_close(sum(_partial(gm)(x) for gm in ranks), model(x), rtol=1e-5, atol=1e-6)


def test_the_users_model_is_not_touched():
    model = MLP()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ids = {k: id(v) for k, v in model.named_parameters()}
    _ranks(model, torch.randn(2, 3, 8))
    assert {k: id(v) for k, v in model.named_parameters()} == ids
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_every_operator_has_a_description_and_an_implementation():
    """One table describes each collective (planner, report, pictures); one runs it (rewriter)."""
    from autotp.passes.steps import COMMUNICATION, Operator

    from autotp.rewrite.collectives import IMPLEMENTATIONS

    from autotp.rewrite.expert_dispatch import EXPERT_IMPLEMENTATIONS

    assert not set(IMPLEMENTATIONS) & set(EXPERT_IMPLEMENTATIONS)
    assert set(COMMUNICATION) == set(Operator) == set(IMPLEMENTATIONS) | set(EXPERT_IMPLEMENTATIONS)
