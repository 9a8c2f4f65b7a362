"""The cost model counts what the textbook formulas say, symbolically in batch and sequence length."""

import sympy
import torch

import autotp
from autotp.capture import capture
from autotp.passes.costs import costs, evaluate
from autotp.passes.graph import trainable_attrs
from tests import models


def _by_target(captured, target):
    return [n for n in captured.graph.nodes if n.op == "call_function" and n.target is target]


def test_linear_and_attention_flops_are_symbolic_in_batch_and_sequence():
    captured = capture(models.build("gpt", layers=1), (models.tokens(2, 16, 0),))
    table = costs(captured.graph, trainable_attrs(captured.module))
    sym = {v: k for k, v in captured.dim_names.items()}
    sizes = {sym["B"]: 3, sym["T"]: 10}
    qkv = _by_target(captured, torch.ops.aten.linear.default)[0]
    assert evaluate(table[qkv.name].flops, sizes) == 2 * 3 * 10 * 64 * 192
    sdpa = _by_target(captured, torch.ops.aten.scaled_dot_product_attention.default)[0]
    assert evaluate(table[sdpa.name].flops, sizes) == 4 * 3 * 4 * 10 * 10 * 16  # quadratic in T
    free = {s.name for s in sympy.sympify(table[sdpa.name].flops).free_symbols}
    assert free == {sym["B"], sym["T"]}


def test_parameters_counted_once_per_tensor():
    model = models.build("gpt", layers=2)
    captured = capture(model, (models.tokens(2, 16, 0),))
    table = costs(captured.graph, trainable_attrs(captured.module))
    assert sum(c.param_count for c in table.values()) == sum(p.numel() for p in model.parameters())


def test_collective_bytes_at_given_sizes():
    plan = autotp.plan(models.build("hf_gpt2"), tp=2, example_inputs=(models.tokens(2, 16, 0),))
    reduce = next(c for c in plan.collectives if c.operator == "g")
    assert reduce.shape in (("B", "T", "64"), ("B*T", "64"))
    assert reduce.nbytes(batch=8, seq=64) == 8 * 64 * 64 * 4


def test_stage_boundary_bytes_are_the_hidden_state():
    plan = autotp.plan(models.build("gpt", layers=4), tp=1, pp=2, batch=8, seq=32,
                       example_inputs=(models.tokens(2, 16, 0),))
    assert (plan.batch, plan.seq) == (8, 32)
    assert plan.stages[0].boundary_bytes == 8 * 32 * 64 * 4 and plan.stages[1].boundary_bytes == 0


def test_data_dependent_sizes_are_costed_at_the_documented_hint():
    import sympy

    from autotp.passes.costs import data_dependent_hint

    u0, batch, seq = sympy.Symbol("u0"), sympy.Symbol("s1"), sympy.Symbol("s2")
    values = {"s1": 4, "s2": 8}
    assert data_dependent_hint(values) == 32
    assert evaluate(2 * u0 * batch, values) == 2 * 32 * 4


def test_expert_matmuls_cost_the_tokens_routed_to_them():
    """A grouped matmul over the experts multiplies each token's k routed copies by one expert's matrix: top-k
    of the B·T tokens, spread over the experts (k/E of the tokens each, on average), 2·in·out FLOPs a row."""
    from tests.moe_workers import TOP_K, mixtral

    captured = capture(mixtral(), (models.tokens(2, 16, 0),))
    table = costs(captured.graph, trainable_attrs(captured.module))
    sym = {v: k for k, v in captured.dim_names.items()}
    sizes = {sym["B"]: 3, sym["T"]: 10}
    grouped = [n for n in captured.graph.nodes if n.op == "call_function" and "grouped_mm" in str(n.target)]
    gate_up, down = grouped[:2]  # [tokens, 64] -> [tokens, 2 * 128], then [tokens, 128] -> [tokens, 64]: layer 0
    assert evaluate(table[gate_up.name].flops, sizes) == 2 * TOP_K * 3 * 10 * 64 * 256
    assert evaluate(table[down.name].flops, sizes) == 2 * TOP_K * 3 * 10 * 128 * 64


class _LoopedExperts(torch.nn.Module):
    """Experts applied in a loop to the tokens routed to each (``torch.where``: a data-dependent count)."""

    def __init__(self, dim=32, experts=4, k=2):
        super().__init__()
        self.k = k
        self.embed = torch.nn.Embedding(64, dim)
        self.router = torch.nn.Linear(dim, experts, bias=False)
        self.experts = torch.nn.ModuleList(torch.nn.Linear(dim, dim, bias=False) for _ in range(experts))

    def forward(self, ids):
        x = self.embed(ids).flatten(0, 1)
        weights, chosen = self.router(x).softmax(-1).topk(self.k, dim=-1)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            token, slot = torch.where(chosen == e)
            out.index_add_(0, token, expert(x[token]) * weights[token, slot, None])
        return out


def test_looped_experts_cost_the_routings_expected_load():
    """Each expert's data-dependent token count is costed at k/E of the tokens, not at all of them."""
    captured = capture(_LoopedExperts(), (models.tokens(2, 8, 0) % 64,))
    table = costs(captured.graph, trainable_attrs(captured.module))
    sym = {v: k for k, v in captured.dim_names.items()}
    sizes = {sym["B"]: 3, sym["T"]: 10}
    experts = [n for n in captured.graph.nodes if n.target is torch.ops.aten.linear.default][1:]
    assert len(experts) == 4
    for node in experts:
        assert evaluate(table[node.name].flops, sizes) == 2 * (3 * 10 * 2 / 4) * 32 * 32


def test_convolution_flops_count_each_output_over_its_groups_kernel():
    from tests.conv_models import InvertedResidual

    captured = capture(InvertedResidual(channels=16, expand=4), (torch.randn(2, 16, 6, 6),))
    table = costs(captured.graph, trainable_attrs(captured.module))
    batch = {v: k for k, v in captured.dim_names.items()}["B"]
    expand, depthwise, project = _by_target(captured, torch.ops.aten.conv2d.default)
    assert evaluate(table[expand.name].flops, {batch: 3}) == 2 * (3 * 64 * 6 * 6) * 16  # 1x1 over 16 channels
    assert evaluate(table[depthwise.name].flops, {batch: 3}) == 2 * (3 * 64 * 6 * 6) * 9  # 3x3 over its one channel
    assert evaluate(table[project.name].flops, {batch: 3}) == 2 * (3 * 16 * 6 * 6) * 64
