"""Inputs as users give them: keyword inputs, padded batches, labels=, and no example inputs at all."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import autotp
from autotp.capture import Signature, synthesise
from autotp.runtime.input_spec import InputSpec
from autotp.tools.model_spec import example_inputs as cli_example_inputs
from tests import inputs_workers, models
from tests.distributed import run_on_ranks


def test_keyword_inputs_with_padding_train_exactly_on_two_ranks():
    """tp=2: padded Llama and GPT-2 batches by keyword with labels; no example inputs; a pp=2 pipeline by name."""
    results = run_on_ranks(inputs_workers.inputs_on_ranks, 2)
    for rank in results:
        assert set(rank["keyword"]) == {"hf_llama (left padding)", "hf_gpt2 (right padding)"}
        for label, errors in rank["keyword"].items():
            assert errors["loss"] < 1e-5 and errors["params"] < 1e-5, label
        assert any("synthesised" in note for note in rank["synthesised"]["notes"])
        assert "not supported with pipeline parallelism" in rank["pipeline"]["labels"]
        assert "pass target=" in rank["pipeline"]["labels"]


@pytest.mark.parametrize("name, side", [("hf_llama", "right"), ("hf_gpt2", "left")])  # the gloo test: the others
def test_padded_keyword_batches_check_exact(name, side):
    torch.manual_seed(0)
    model = inputs_workers.BUILDERS[name]()
    batch = inputs_workers.padded_batch(side)
    report = autotp.check(model, tp=2, example_inputs=batch)
    assert report.exact, str(report)
    assert torch.isfinite(model(**batch, use_cache=False).logits).all()  # NaNs would compare equal


def test_no_example_inputs_synthesises_token_ids_and_says_so():
    model = models.build("gpt")
    plan = autotp.plan(model, tp=2)
    assert any("synthesised" in note and "(2, 32)" in note and "idx" in note for note in plan.notes), plan.notes
    given = autotp.plan(model, tp=2, example_inputs=(models.tokens(2, 16, 0),)).notes
    assert not any("synthesised" in note for note in given), given
    report = autotp.check(model, tp=2)
    assert report.exact and any("synthesised" in note for note in report.plan.notes), str(report)


def test_the_cli_synthesises_the_same_ids_as_the_library():
    model = models.build("gpt")
    assert torch.equal(cli_example_inputs(model)[0], synthesise(model).flat[0])


class _FloatInputs(nn.Module):
    """Takes hidden states, not token ids: nothing to draw ids from."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        return self.proj(x)


class _PositionsOnly(_FloatInputs):
    """Has an embedding (of positions), but takes hidden states: synthesised ids do not fit."""

    def __init__(self):
        super().__init__()
        self.pos = nn.Embedding(32, 8)

    def forward(self, x):
        return self.proj(x) + self.pos.weight[: x.shape[1]]


def test_a_model_whose_inputs_cannot_be_guessed_is_refused_with_the_fix():
    with pytest.raises(autotp.InputError, match="cannot guess the inputs of _FloatInputs.*pass example_inputs="):
        autotp.plan(_FloatInputs(), tp=2)
    with pytest.raises(autotp.CaptureError, match="synthesised token ids.*pass its inputs as example_inputs"):
        autotp.plan(_PositionsOnly(), tp=2)


@pytest.mark.parametrize("example, message", [
    ({"input_ids": models.tokens(2, 8, 0), "input_embeds": torch.zeros(2, 8, 64)},
     "input_embeds= is not a parameter of the model's forward.*did you mean inputs_embeds="),
    ({"input_ids": models.tokens(2, 8, 0), "attention_mask": [1, 1]}, r"example_inputs\['attention_mask'\] is a list"),
    ({}, "got an empty dict"),
    ({"input_ids": models.tokens(2, 8, 0), "use_cache": True}, r"example_inputs\['use_cache'\] is a bool"),
])
def test_bad_keyword_examples_say_what_and_what_to_pass(example, message):
    torch.manual_seed(0)
    with pytest.raises(autotp.InputError, match=message):
        autotp.plan(inputs_workers.hf_llama(), tp=2, example_inputs=example)


@pytest.fixture(scope="module")
def llama_with_labels():
    """A tiny Llama, a left-padded batch with labels, and its tp=1 parallel module captured on that batch
    (with a None for a None default, which means "not given")."""
    torch.manual_seed(0)
    model = inputs_workers.hf_llama()
    batch = inputs_workers.padded_batch("left")
    given = dict(batch)
    pm = autotp.parallelize(model, tp=1, example_inputs={**batch, "position_ids": None})
    assert given.keys() == batch.keys() and all(given[k] is batch[k] for k in batch)  # nothing mutated
    return model, batch, pm


def test_inputs_are_named_by_the_parameter_they_bind_to(llama_with_labels):
    """Positional or keyword, in any order, None for a None default: one call; twice: refused. Without the labels
    it was captured with, a forward gives the model's output without them; a loss still needs them."""
    model, batch, pm = llama_with_labels
    want = model(**batch, use_cache=False)
    for got in (pm(**batch), pm(batch["input_ids"], batch["attention_mask"], labels=batch["labels"]),
                pm(labels=batch["labels"], attention_mask=batch["attention_mask"], input_ids=batch["input_ids"],
                   inputs_embeds=None)):
        torch.testing.assert_close(got.logits, want.logits)
        torch.testing.assert_close(got.loss, want.loss)
    with pytest.raises(autotp.InputError, match="gives 'input_ids' twice"):
        pm(batch["input_ids"], input_ids=batch["input_ids"])
    unlabelled = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    got = pm(**unlabelled)
    assert "loss" not in got
    torch.testing.assert_close(got.logits, model(**unlabelled, use_cache=False).logits)
    with pytest.raises(autotp.InputError, match="input labels is missing.*captured with input_ids, attention_mask"):
        pm.loss(**unlabelled)


def test_step_on_the_models_own_loss_and_on_a_target(llama_with_labels):
    model, batch, pm = llama_with_labels  # step leaves the parameters as they are (no optimizer here)
    torch.testing.assert_close(pm.step(**batch), model(**batch, use_cache=False).loss.detach())
    target = models.tokens(4, 12, 3)
    torch.testing.assert_close(pm.step(**batch, target=target),
                               models.loss_fn(model(**batch, use_cache=False), target).detach())
    with pytest.raises(autotp.InputError, match="loss_fn is called as loss_fn\\(output, target\\)"):
        pm.step(**batch, loss_fn=models.loss_fn)


def test_step_without_a_loss_names_both_ways():
    pm = autotp.parallelize(models.build("gpt"), tp=1, example_inputs={"idx": models.tokens(2, 8, 0)})
    with pytest.raises(autotp.InputError, match="pass target=.*or labels=.*this model's output has no loss"):
        pm.step(idx=models.tokens(2, 8, 0))
    # A model that takes labels, captured without them: the graph has no loss; say how to get one.
    spec = InputSpec(("input_ids",), (torch.int64,), (2,), Signature.of(inputs_workers.hf_llama()))
    with pytest.raises(autotp.InputError, match="labels is not an input the model was captured with.*capture with "
                                                "labels too"):
        spec.arrange((), {"input_ids": models.tokens(2, 8, 0), "labels": models.tokens(2, 8, 0)})


class _SubConfig:
    """A sub-config as transformers makes them: a vocabulary and ``to_dict``."""

    def __init__(self, vocab_size):
        self.vocab_size = vocab_size

    def to_dict(self):
        return {"vocab_size": self.vocab_size}


class _EncoderDecoder(nn.Module):
    """Vocabularies only in sub-configs, and a position table larger than either (an encoder-decoder of two
    tiny encoders): ids drawn below the largest table would not fit the vocabularies."""

    def __init__(self):
        super().__init__()
        self.config = _SubConfig(None)
        self.config.encoder, self.config.decoder = _SubConfig(48), _SubConfig(40)
        self.tokens, self.positions = nn.Embedding(48, 8), nn.Embedding(512, 8)


def test_synthesised_ids_fit_every_sub_config_vocabulary():
    (ids,) = synthesise(_EncoderDecoder()).flat
    assert int(ids.max()) < 40
