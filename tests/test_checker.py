"""The one-process checker: exact plans pass, injected faults are caught and located by module."""

from __future__ import annotations


import pytest
import torch

import autotp
from autotp.rewrite.vocab_parallel import masked_embedding
from examples.gpt import build_gpt
from tests import models

IDS = models.tokens(2, 16, 0)


@pytest.mark.parametrize("name, tp", [("gpt", 2), ("gpt", 4), ("llama", 4), ("raw_gpt", 2), ("hf_gpt2", 2),
                                      ("hf_llama", 4), ("hf_bert", 2)])
def test_models_check_exact(name, tp):
    torch.manual_seed(0)
    report = autotp.check(models.build(name), tp=tp, vocab="split", example_inputs=(IDS,))
    assert report.exact, str(report)
    assert report.compared > 20 and report.max_error < 1e-4


def test_dropout_is_exact_in_one_process():
    """Dropout on (0.2), replicated and split values alike: the ranks' masks are the unsharded model's."""
    torch.manual_seed(0)
    report = autotp.check(build_gpt(n_layer=2, dropout=0.2), tp=4, vocab="split", example_inputs=(IDS,))
    assert report.exact, str(report)


@pytest.mark.parametrize("tied", [True, False])
def test_padding_row_is_honoured(tied):
    torch.manual_seed(0)
    model = models.PaddedLM(tied)
    report = autotp.check(model, tp=2, vocab="split", example_inputs=(models.padded_ids(),))
    assert report.exact, str(report)
    assert autotp.plan(model, tp=2, vocab="split", example_inputs=(models.padded_ids(),)).placements["embed.weight"].is_split


def test_a_four_layer_model_checks_every_tensor_at_tp4():
    torch.manual_seed(0)
    model = build_gpt(n_layer=4)
    report = autotp.check(model, tp=4, vocab="split", example_inputs=(IDS,))
    params = len(list(model.parameters()))
    assert report.exact, str(report)
    assert report.compared >= 2 * params + 2, f"{report.compared} tensors compared for {params} parameters"


def test_a_dropped_all_reduce_is_found_and_located():
    def drop_second_all_reduce(modules, comms):
        comms[1].dropped = {1}  # the 0th is the embedding's; the 1st closes the first attention

    torch.manual_seed(0)
    report = autotp.check(build_gpt(n_layer=2), tp=2, vocab="split", example_inputs=(IDS,), modules_hook=drop_second_all_reduce)
    assert not report.exact and report.mismatch.what in ("output", "loss")
    assert report.located is not None and "transformer.h.0.attn" in report.located.where, str(report)
    assert "rank 1" in report.located.where


def test_a_mis_sliced_shard_is_found_and_located():
    def roll_rank1_fc(modules, comms):
        weight = dict(modules[1].named_parameters())["model.transformer.h.1.mlp.c_fc.weight"]
        with torch.no_grad():
            weight.copy_(weight.roll(1, dims=0))

    torch.manual_seed(0)
    report = autotp.check(build_gpt(n_layer=2), tp=2, vocab="split", example_inputs=(IDS,), modules_hook=roll_rank1_fc)
    assert not report.exact
    assert "transformer.h.1.mlp.c_fc" in report.located.where, str(report)


def test_an_unmasked_padding_row_is_found_by_its_gradient():
    def forget_padding(modules, comms):
        for gm in modules:
            for node in gm.graph.nodes:
                if node.target is masked_embedding:
                    node.args = (*node.args[:4], -1)
            gm.recompile()

    torch.manual_seed(0)
    report = autotp.check(models.PaddedLM(tied=False), tp=2, vocab="split", example_inputs=(models.padded_ids(),), modules_hook=forget_padding)
    assert not report.exact and report.mismatch.what == "gradient"
    assert report.mismatch.where == "embed.weight", str(report)


def test_a_hand_edited_plan_is_checked():
    torch.manual_seed(0)
    model = build_gpt(n_layer=2)
    plan = autotp.plan(model, tp=2, vocab="split", example_inputs=(IDS,))
    assert autotp.check(model, tp=2, vocab="split", example_inputs=(IDS,), plan=plan).exact
    with pytest.raises(autotp.PlanError, match="made for tp=2"):
        autotp.check(model, tp=4, vocab="split", example_inputs=(IDS,), plan=plan)


class _DropoutOfViews(torch.nn.Module):
    """Dropout on a transposed and on an expanded value: torch draws their masks in their memory order."""

    def __init__(self):
        super().__init__()
        self.up, self.down = torch.nn.Linear(16, 64), torch.nn.Linear(64, 16)
        self.table = torch.nn.Parameter(torch.randn(8, 1, 16))

    def forward(self, x):
        b, t, d = x.shape
        x = x + torch.nn.functional.dropout(self.table[:t].expand(t, b, d), 0.3).transpose(0, 1)
        y = torch.nn.functional.dropout(self.up(x).transpose(1, 2), 0.3).transpose(1, 2)
        return self.down(torch.relu(y))


@pytest.mark.parametrize("tp", [1, 2])
def test_dropout_of_transposed_and_expanded_values_is_exact(tp):
    torch.manual_seed(0)
    report = autotp.check(_DropoutOfViews(), tp=tp, vocab="split", example_inputs=(torch.randn(2, 8, 16),))
    assert report.exact, str(report)


class _Sharp(torch.nn.Module):
    """Attention with huge scores: a row split's reordered sums (rounding) are amplified past float32's
    tolerance, though the sharded model computes the same function."""

    def __init__(self, d=16, sharpness=400.0):
        super().__init__()
        self.norm = torch.nn.LayerNorm(d)
        self.q, self.k = torch.nn.Linear(d, d), torch.nn.Linear(d, d)
        self.sharpness = sharpness

    def forward(self, x):
        h = self.norm(x)
        scores = (self.q(h) @ self.k(h).transpose(-1, -2)) * self.sharpness
        return scores.softmax(-1) @ h


def test_float32_rounding_is_told_apart_from_a_bug_in_float64():
    torch.manual_seed(0)
    report = autotp.check(_Sharp(), 2, torch.randn(2, 8, 16))
    assert report.exact and report.plan.placements["q.weight"].is_split
    if report.rounding is not None:  # float32 differed: float64 showed it to be rounding, and says so
        assert "rounding" in str(report)


def test_a_real_fault_is_not_excused_as_rounding():
    torch.manual_seed(0)
    report = autotp.check(_Sharp(), 2, torch.randn(2, 8, 16), modules_hook=_fault_on_rank_one)
    assert not report.exact and report.rounding is None


def _fault_on_rank_one(modules, comms):
    """Scale rank 1's output: a wrong answer the float64 re-check must not excuse."""
    for node in modules[1].graph.nodes:
        if node.op == "output":
            with modules[1].graph.inserting_before(node):
                first, *rest = node.args[0]
                node.args = ((modules[1].graph.call_function(torch.mul, (first, 1.001)), *rest),)
    modules[1].recompile()


def test_an_autotp_error_in_the_float64_recheck_is_raised_not_taken_for_the_models():
    def fault_then_fail_in_float64(modules, comms):
        if next(modules[0].parameters()).dtype == torch.float64:
            raise autotp.errors.InternalError("a bug of autotp's in the float64 pass")
        _fault_on_rank_one(modules, comms)

    torch.manual_seed(0)
    with pytest.raises(autotp.errors.InternalError, match="float64 pass"):
        autotp.check(_Sharp(), 2, torch.randn(2, 8, 16), modules_hook=fault_then_fail_in_float64)


class _CastsToFloat32(_Sharp):
    """Casts to float32 itself: cannot run in float64."""

    def __init__(self):
        super().__init__()
        self.register_buffer("mix", torch.eye(16))

    def forward(self, x):
        return super().forward(x).float() @ self.mix


def test_a_model_that_cannot_run_in_float64_keeps_its_float32_report():
    torch.manual_seed(0)
    report = autotp.check(_CastsToFloat32(), 2, torch.randn(2, 8, 16), modules_hook=_fault_on_rank_one)
    assert not report.exact and report.rounding is None


def test_one_capture_checks_every_tp_as_check_does():
    from autotp.checker import check_prepared, prepare

    torch.manual_seed(0)
    model = build_gpt(n_layer=2)
    prepared = prepare(model, (IDS,))
    for tp in (2, 4):
        once = check_prepared(prepared, tp, vocab="split")
        alone = autotp.check(model, tp, (IDS,), vocab="split")
        assert once.exact and alone.exact, (str(once), str(alone))
        assert once.plan.placements == alone.plan.placements and once.compared == alone.compared
        assert once.max_error == alone.max_error


class _Reverse(torch.autograd.Function):
    """Gradient reversal: identity forward, negated gradient backward (a custom backward autograd would not give)."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return -grad


class _Reversed(torch.nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.a, self.up, self.down = torch.nn.Linear(d, d), torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d)

    def forward(self, x):
        return self.down(torch.relu(self.up(_Reverse.apply(self.a(x)))))


def test_a_custom_backward_other_than_the_derivative_is_refused_for_training_and_named_in_inference():
    torch.manual_seed(0)
    model, x = _Reversed(), torch.randn(2, 8, 16)
    applied = torch.autograd.Function.__dict__["apply"]
    with pytest.raises(autotp.errors.CaptureError, match="_Reverse whose backward is not the derivative"):
        autotp.plan(model, 2, vocab="split", example_inputs=(x,))  # training would follow autograd, not -grad
    assert torch.autograd.Function.__dict__["apply"] is applied  # restored after capture
    plan = autotp.plan(model.eval(), 2, vocab="split", example_inputs=(x,))
    assert any("_Reverse" in n and "backward" in n for n in plan.notes), plan.notes


class _DrawnDropout(torch.autograd.Function):
    """SEW-D's ``XDropout``: the mask drawn in place into a fresh tensor, ``empty_like(x).bernoulli_(1 - p)``."""

    @staticmethod
    def forward(ctx, x, p):
        mask = (1 - torch.empty_like(x).bernoulli_(1 - p)).to(torch.bool)
        ctx.save_for_backward(mask)
        ctx.scale = 1 / (1 - p)
        return x.masked_fill(mask, 0) * ctx.scale

    @staticmethod
    def backward(ctx, grad):
        (mask,) = ctx.saved_tensors
        return grad.masked_fill(mask, 0) * ctx.scale, None


class _FoldedHeadsAttention(torch.nn.Module):
    """SEW-D's attention in small: heads folded into the batch for ``bmm`` ([batch * heads, tokens, head dim]), its
    probabilities dropped by ``_DrawnDropout``."""

    def __init__(self, width=32, heads=4):
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.out = (torch.nn.Linear(width, width) for _ in range(4))

    def fold(self, x):
        b, t, _ = x.shape
        return x.view(b, t, self.heads, -1).permute(0, 2, 1, 3).contiguous().view(-1, t, x.shape[-1] // self.heads)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.fold(self.q(x)), self.fold(self.k(x)), self.fold(self.v(x))
        probs = torch.softmax(torch.bmm(q, k.transpose(-1, -2)) / 4, -1).view(b, self.heads, t, t)
        probs = _DrawnDropout.apply(probs, 0.3).view(-1, t, t)
        context = torch.bmm(probs, v).view(b, self.heads, t, -1).permute(0, 2, 1, 3).reshape(b, t, d)
        return self.out(context)


def test_attention_with_heads_in_the_batch_and_an_in_place_drawn_dropout_splits_by_heads_exactly():
    """The mask drawn in place into a fresh value is drawn out of place at capture, laid out like the split
    probabilities, full-size on every rank and sliced: the attention splits by heads (it was kept whole: an
    in-place write to a split value) and stays exact."""
    torch.manual_seed(0)
    model, x = _FoldedHeadsAttention(), torch.randn(2, 6, 32)
    plan = autotp.plan(model, tp=2, example_inputs=(x,))
    regions = [r for r in plan.regions if r.columns]
    assert len(regions) == 1, plan.notes
    assert set(regions[0].columns) == {"q", "k", "v"} and regions[0].rows == ("out",), plan
    report = autotp.check(model, tp=2, example_inputs=(x,))
    assert report.exact, str(report)


class _NoFloat64Kernel(_Sharp):
    """Runs in bf16 and float32 only, as a grouped-GEMM mixture of experts does.

    Scores scaled by 4, not 400: its widest dtype is float32, in which 400's amplified rounding exceeds float32's
    own tolerances (the float32 test above needs float64 for it; here it failed on torch 2.13.0 and 2.14.1 alike,
    gradient 1.9e-6 off). At 4, bf16 still differs past its tolerances and float32 shows that to be rounding."""

    def __init__(self, d=16):
        super().__init__(d, sharpness=4.0)

    def forward(self, x):
        if x.dtype == torch.float64:
            raise TypeError("expected a float32, bfloat16 or float16 matrix, got double")
        return super().forward(x)


@pytest.mark.parametrize("model_class, widened", [(_Sharp, "float64"), (_NoFloat64Kernel, "float32")])
def test_bf16_rounding_is_told_apart_in_the_widest_dtype_the_model_runs_in(model_class, widened):
    torch.manual_seed(0)
    model, x = model_class().to(torch.bfloat16), torch.randn(2, 8, 16).to(torch.bfloat16)
    report = autotp.check(model, 2, x)
    assert report.exact and report.rounding is not None and report.widened == widened, str(report)
    assert f"in {widened}" in str(report) and next(model.parameters()).dtype == torch.bfloat16


@pytest.mark.parametrize("model_class", [_Sharp, _NoFloat64Kernel])
def test_a_fault_below_bf16_rounding_is_not_excused(model_class):
    torch.manual_seed(0)
    model, x = model_class().to(torch.bfloat16), torch.randn(2, 8, 16).to(torch.bfloat16)
    report = autotp.check(model, 2, x, modules_hook=_fault_on_rank_one)  # a 0.1% error, under bf16's 0.4% step
    assert not report.exact and report.rounding is None
