"""The tensor-parallel rewriter on tiny graphs: slices, fixed constants, inserted collectives, one process.

The reductions are swapped for identities here, so each rank's module returns its partial sum; the
ranks' outputs then add up to the original model's (the real all-reduce is tested on gloo ranks).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.testing import assert_close

from autotp.planning import make_plan
from autotp.rewrite import rewrite
from autotp.rewrite.collectives import CopyToTP, ReduceFromTP
from autotp.rewrite.shards import local_shard
from tests.graphs import MLP, Heads, captured

aten = torch.ops.aten


def _ranks(model, x, tp=2):
    cap = captured(model, x)
    plan = make_plan(cap, tp)
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


def test_collectives_are_inserted_as_megatrons_f_and_g():
    _, _, (gm, _) = _ranks(MLP(), torch.randn(2, 3, 8))
    kinds = [type(m) for _, m in gm.named_children() if m.__class__.__module__.startswith("autotp")]
    assert kinds.count(CopyToTP) == 1 and kinds.count(ReduceFromTP) == 1
    order = [n.target for n in gm.graph.nodes if n.op in ("call_module", "call_function")]
    f_at = next(i for i, n in enumerate(gm.graph.nodes) if n.op == "call_module" and "copytotp" in n.target)
    linear_at = next(i for i, n in enumerate(gm.graph.nodes) if n.target is aten.linear.default)
    assert f_at < linear_at, order


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

    assert set(COMMUNICATION) == set(Operator) == set(IMPLEMENTATIONS)
