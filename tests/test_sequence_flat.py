"""Sequence parallelism for layers computed on tokens flattened to ``[B*T, C]`` (GPT-2's ``Conv1D``, a hand-written
``x.reshape(-1, C) @ W``): Megatron's all-gather into each region and reduce-scatter out of it, as for ``[B, T]``
layers (``passes.sequence_flat``); exact."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

import autotp
from autotp.passes.steps import Operator
from tests import models
from tests.test_sequence_parallel import _gpt

transformers = pytest.importorskip("transformers")


class FlatMlp(torch.nn.Module):
    """Two residual MLPs computed on flattened tokens: ``nn.Linear`` layers (the row's bias in its ``linear``), then
    bare matrices with the down bias added after the product."""

    def __init__(self, d: int = 64):
        super().__init__()
        self.embed, self.norm = torch.nn.Embedding(models.VOCAB, d), torch.nn.LayerNorm(d)
        self.up, self.down = torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d)
        self.w_up = torch.nn.Parameter(torch.randn(d, 4 * d) * 0.05)
        self.w_down = torch.nn.Parameter(torch.randn(4 * d, d) * 0.05)
        self.b_down = torch.nn.Parameter(torch.randn(d) * 0.1)
        self.head = torch.nn.Linear(d, models.VOCAB)

    def forward(self, ids):
        h = self.embed(ids)
        b, t, c = h.shape
        y = torch.nn.functional.gelu(self.up(self.norm(h).reshape(-1, c)))
        h = h + self.down(y).view(b, t, c)
        y = torch.nn.functional.gelu(self.norm(h).reshape(-1, c) @ self.w_up)
        return self.head(h + (y @ self.w_down + self.b_down).reshape(b, t, c))


def _gpt2(dropout: float = 0.1):
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=models.VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64, resid_pdrop=dropout,
        embd_pdrop=dropout, attn_pdrop=dropout))


def _counts(plan) -> Counter:
    return Counter((c.operator, c.op, c.direction) for c in plan.collectives)


def test_gpt2_rows_reduce_scatter_and_regions_gather_at_megatrons_count():
    """GPT-2 plans the collectives ``examples.gpt`` (the same model in ``nn.Linear`` layers) plans, with no
    all-reduce left forward, less the 4 rows' bias gradient all-reduces: each bias is added by one rank to the
    partial sum before the reduce-scatter, so its gradient is whole on every rank."""
    ids = models.tokens(2, 8, 0)
    flat = autotp.plan(_gpt2(), 2, ids, vocab="split", sequence_parallel=True)
    linear = autotp.plan(_gpt(), 2, ids, vocab="split", sequence_parallel=True)
    fewer = _counts(linear) - _counts(flat)
    assert not (_counts(flat) - _counts(linear)) and sum(fewer.values()) == 4, fewer
    assert {key[0] for key in fewer} == {Operator.F}
    assert {c.module for c in linear.collectives if c.operator is Operator.F} - \
        {c.module for c in flat.collectives if c.operator is Operator.F} == {
        f"transformer.h.{i}.{part}.c_proj" for i in (0, 1) for part in ("attn", "mlp")}
    assert Operator.G not in {c.operator for c in flat.collectives} and not flat.notes


@pytest.mark.parametrize("name", ["gpt2", "openai-gpt", "flat-mlp"])
def test_flattened_layers_check_exact_under_sequence_parallelism(name):
    """Dropout on (GPT-2, OpenAI GPT), bare matrices with a bias added after the product: exact, and every row's
    reduction a reduce-scatter."""
    torch.manual_seed(0)
    model = {"gpt2": _gpt2, "flat-mlp": FlatMlp,
             "openai-gpt": lambda: transformers.OpenAIGPTLMHeadModel(transformers.OpenAIGPTConfig(
                 vocab_size=models.VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64))}[name]()
    report = autotp.check(model, 2, models.tokens(2, 8, 0), vocab="split", sequence_parallel=True)
    assert report.exact, str(report)
    operators = {c.operator for c in report.plan.collectives}
    assert Operator.G not in operators and Operator.REDUCE_SCATTER in operators, report.plan.collectives


def test_a_flattened_model_refuses_a_sequence_tp_does_not_divide_as_others_do():
    with pytest.raises(autotp.InputError, match="pad the sequence to a multiple of 2"):
        autotp.check(_gpt2(0.0), 2, models.tokens(2, 7, 0), vocab="split", sequence_parallel=True)


def test_gpt2_with_lora_checks_exact_at_the_base_models_forward_collectives():
    """LoRA (peft) on c_attn, c_proj and c_fc at tp=2, dropout 0.1 in the model and the adapters: exact, and the
    forward's collectives are the base model's (the adapters ride on its all-gathers and reduce-scatters)."""
    peft = pytest.importorskip("peft")
    base = _gpt2()
    model = peft.get_peft_model(_gpt2(), peft.LoraConfig(r=4, target_modules=["c_attn", "c_proj", "c_fc"],
                                                         lora_dropout=0.1, fan_in_fan_out=True))
    torch.manual_seed(1)
    for key, p in model.named_parameters():
        if "lora_B" in key:
            torch.nn.init.normal_(p, std=0.05)
    x = models.tokens(2, 8, 1)
    report = autotp.check(model, 2, (x,), sequence_parallel=True)
    assert report.exact, str(report)
    adapted, plain = (Counter({k: n for k, n in _counts(p).items() if k[2].value == "forward"})
                      for p in (report.plan, autotp.plan(base, 2, (x,), sequence_parallel=True)))
    assert adapted == plain and Operator.G not in {k[0] for k in adapted}, (adapted, plain)


@pytest.mark.slow
def test_gpt2_sequence_parallel_with_pipelines_on_four_ranks():
    """tp=2 x pp=2: stages pass GPT-2's sequence shards on; AdamW steps equal one process's."""
    from tests import capture_cache, sequence_workers
    from tests.distributed import run_on_ranks

    capture_cache.warm(models.build("hf_gpt2", layers=4), (models.tokens(2, 16, seed=1),))
    for rank in run_on_ranks(sequence_workers.gpt2_pipelined, 4):
        assert rank["plan"] and rank["params"] < 1e-5, rank
