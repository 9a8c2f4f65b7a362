"""Sequence parallelism (Megatron's arXiv 2205.05198): the residual stream between regions split along the
sequence, rows reduce-scattered, regions entered by an all-gather whose backward reduce-scatters; exact."""

from __future__ import annotations

import pytest
import torch

import autotp
from autotp.passes.steps import CollectiveOp, Direction, Operator
from examples.gpt import build_gpt
from tests import capture_cache, models, sequence_workers
from tests.distributed import run_on_ranks
from tests.inputs_workers import padded_batch


def _gpt(dropout: float = 0.1):
    torch.manual_seed(0)
    return build_gpt(n_layer=2, n_head=4, n_embd=64, vocab_size=models.VOCAB, block_size=64, dropout=dropout)


def _by_operator(plan) -> dict[Operator, list]:
    out: dict[Operator, list] = {}
    for c in plan.collectives:
        out.setdefault(c.operator, []).append(c)
    return out


def test_rows_reduce_scatter_and_regions_gather_along_the_sequence():
    ids = models.tokens(2, 8, 0)
    plain = autotp.plan(_gpt(), 2, ids, vocab="split")
    plan = autotp.plan(_gpt(), 2, ids, vocab="split", sequence_parallel=True)
    ops = _by_operator(plan)
    assert plan.sequence_parallel and not plain.sequence_parallel
    # The 4 rows and the split embedding reduce-scatter (all-gather backward) instead of all-reducing ...
    assert len([c for c in _by_operator(plain)[Operator.G]]) == 4 and Operator.G not in ops
    scatters = ops[Operator.REDUCE_SCATTER]
    assert len(scatters) == 2 * 5
    assert {(c.op, c.direction) for c in scatters} == {(CollectiveOp.REDUCE_SCATTER, Direction.FORWARD),
                                                      (CollectiveOp.ALL_GATHER, Direction.BACKWARD)}
    # ... the 4 regions and the LM head are entered by an all-gather that reduce-scatters backward ...
    gathers = ops[Operator.GATHER_TO_REGION]
    assert len(gathers) == 2 * 5 and {c.module for c in gathers} == {
        "transformer.h.0.ln_1", "transformer.h.0.ln_2", "transformer.h.1.ln_1", "transformer.h.1.ln_2",
        "transformer.ln_f"}
    # ... and the norms, and the rows' biases (added to each rank's tokens), get their gradients all-reduced.
    shared = {c.module for c in ops[Operator.F]}
    assert {"transformer.h.0.ln_1", "transformer.ln_f", "transformer.h.1.mlp.c_proj"} <= shared
    assert all(c.direction is Direction.BACKWARD for c in ops[Operator.F])
    # The position lookup (ids shared by the batch) stays whole and is sliced where it meets the token embeddings.
    assert [(c.shape, c.direction) for c in ops[Operator.SCATTER]] == [(("T", "64"), Direction.BACKWARD)]
    assert plan.to_json() != plain.to_json() and autotp.Plan.from_json(plan.to_json()) == plan


GPT2_LIKE = ("gpt_dropout", "hf_llama", "hf_bert", "hf_gpt2", "t5", "mixtral")


def _hf(name: str):
    import transformers

    small = dict(vocab_size=models.VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4)
    if name == "t5":
        return transformers.T5ForConditionalGeneration(transformers.T5Config(vocab_size=models.VOCAB, d_model=64,
                                                                             d_ff=128, num_layers=2, num_heads=4,
                                                                             d_kv=16))
    if name == "mixtral":
        return transformers.MixtralForCausalLM(transformers.MixtralConfig(
            **small, intermediate_size=128, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2))
    return models.BUILDERS[name]()


@pytest.mark.parametrize("name, tp, vocab", [("gpt_dropout", 2, "whole"), ("gpt_dropout", 4, "split"),
                                             ("hf_llama", 2, "split"), ("hf_bert", 2, "split"),
                                             ("hf_gpt2", 2, "split"), ("t5", 2, "split"), ("mixtral", 2, "split")])
def test_sequence_parallel_checks_exact(name, tp, vocab):
    """Dropout on, whole and split vocabularies, an encoder's hidden states (gathered along the sequence), an
    encoder-decoder (two sequences), mixture-of-experts (routed tokens gathered), GPT-2's flattened rows."""
    torch.manual_seed(0)
    model = _gpt() if name == "gpt_dropout" else _hf(name)
    ids = models.tokens(2, 8, 0)
    example = {"input_ids": ids, "decoder_input_ids": models.tokens(2, 4, 1)} if name == "t5" else ids
    report = autotp.check(model, tp, example, vocab=vocab, sequence_parallel=True)
    assert report.exact, str(report)
    assert report.plan.sequence_parallel


class TwoStreams(torch.nn.Module):
    """Two streams concatenated along the sequence (as ProphetNet's main and predicting streams are)."""

    def __init__(self):
        super().__init__()
        self.embed, self.head = torch.nn.Embedding(models.VOCAB, 64), torch.nn.Linear(64, models.VOCAB)
        self.up, self.down = torch.nn.Linear(64, 128), torch.nn.Linear(128, 64)
        self.up2, self.down2 = torch.nn.Linear(64, 128), torch.nn.Linear(128, 64)

    def forward(self, ids):
        h = self.embed(ids)
        h = h + self.down(torch.relu(self.up(h)))
        both = torch.cat([h, 0.5 * h], dim=1)
        return self.head(both + self.down2(torch.relu(self.up2(both))))


def test_sequence_shards_side_by_side_stay_exact():
    """A cat of two sequence-split values along the sequence is kept whole (each part's size is dynamic)."""
    torch.manual_seed(0)
    report = autotp.check(TwoStreams(), 2, models.tokens(2, 8, 0), vocab="split", sequence_parallel=True)
    assert report.exact, str(report)


def test_sequence_parallel_refuses_what_it_cannot_split():
    layer = torch.nn.TransformerEncoderLayer(64, 4, 128, batch_first=True)
    encoder = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
    with pytest.raises(autotp.PlanError, match="no such ids with a dynamic sequence length"):
        autotp.plan(encoder, 2, torch.randn(2, 8, 64), sequence_parallel=True)
    with pytest.raises(autotp.InputError, match="sequence_parallel must be True or False"):
        autotp.plan(_gpt(), 2, models.tokens(2, 8, 0), sequence_parallel="yes")


def test_sequence_parallel_trains_exactly_and_saves_less_on_two_ranks():
    results = run_on_ranks(sequence_workers.sequence_parallel_on_ranks, 2)
    for rank in results:
        assert set(rank["padded"]) == {"hf_llama (left padding)", "hf_gpt2 (right padding)"}
        for label, errors in rank["padded"].items():
            assert errors["loss"] < 1e-5 and errors["params"] < 1e-5, label
        memory = rank["memory"]
        assert memory["sequence parallel"] < 0.9 * memory["plain"], memory  # norms, dropout masks, residuals: half per rank
        assert "pad it to a multiple of 2" in memory["odd"]
    assert padded_batch("left")["input_ids"].shape[1] % 2 == 0


def test_sequence_parallel_with_pipelines_and_replicas_on_four_ranks():
    """tp=2 x pp=2 (stages pass sequence shards) and dp=2 x tp=2 under FSDP, each against one process."""
    example = (models.tokens(2, 16, seed=1),)  # both models captured here once, not once per rank (4 on 2 cores)
    capture_cache.warm(models.build("hf_llama", layers=4), example)
    capture_cache.warm(models.build("gpt", layers=1), example)
    for rank in run_on_ranks(sequence_workers.on_four_ranks, 4):
        assert rank["pipelined"]["plan"] and rank["pipelined"]["params"] < 1e-5
        assert rank["fsdp"]
