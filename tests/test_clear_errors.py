"""Bad inputs and hand-edited plans each give one clear autotp error (issue 22, "Other crashes and unclear
errors"): a swapped MLP's bias, the true list of valid tp, float token ids, a short attention mask, an empty
batch."""

from __future__ import annotations

import json

import pytest
import torch

import autotp
from autotp.tools import cli
from tests import inputs_workers, models

GPT = "examples/gpt.py:build_gpt"
FC, PROJ = "transformer.h.0.mlp.c_fc", "transformer.h.0.mlp.c_proj"


def _swapped(plan: autotp.Plan, biases: bool) -> autotp.Plan:
    """``plan`` with the first MLP's projections swapped (first rowwise, second colwise); ``biases``: theirs too."""
    data = json.loads(plan.to_json())
    placements = data["placements"]
    placements[FC + ".weight"], placements[PROJ + ".weight"] = placements[PROJ + ".weight"], placements[FC + ".weight"]
    if biases:
        placements[PROJ + ".bias"], placements[FC + ".bias"] = placements[FC + ".bias"], placements[PROJ + ".bias"]
    return autotp.Plan.from_json(json.dumps(data))


def test_an_mlp_swapped_by_hand_is_refused_at_plan_check_or_exact(tmp_path, capsys):
    model, x = models.build("gpt"), models.tokens(2, 16, 0)
    plan = autotp.plan(model, tp=2, example_inputs=(x,))
    with pytest.raises(autotp.PlanError, match=rf"the plan splits {FC}.weight rowwise \(dim 1\) but its bias "
                                               rf"{FC}.bias colwise \(dim 0\): a bias is split as its weight's "
                                               r"outputs are \(here: replicated\)"):
        autotp.check(model, tp=2, example_inputs=(x,), plan=_swapped(plan, biases=False))
    assert autotp.check(model, tp=2, example_inputs=(x,), plan=_swapped(plan, biases=True)).exact
    # The command line says it in one line, as the user's mistake (exit 2), not as an internal error.
    path = tmp_path / "swapped.json"
    path.write_text(_swapped(plan, biases=False).to_json())
    assert cli.main(["check", GPT, "--plan", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("autotp: error: the plan splits") and err.count("\n") == 1, err


def test_valid_tp_values_are_the_true_list_and_heads_are_blamed():
    """4 query heads and 2 KV heads: tp=4 works (each KV head shared by two ranks), so it is listed."""
    torch.manual_seed(0)
    model = inputs_workers.hf_llama()
    assert autotp.plan(model, tp=4, example_inputs=(models.tokens(2, 8, 0),)).tp == 4
    with pytest.raises(autotp.PlanError) as err:
        autotp.plan(model, tp=3, example_inputs=(models.tokens(2, 8, 0),))
    text = str(err.value)
    assert "Valid tp values for this model: 1, 2, 4." in text, text
    assert "(the attention heads)" in text, text


def test_float_token_ids_in_example_inputs_are_one_input_error():
    with pytest.raises(autotp.InputError) as err:
        autotp.plan(models.build("gpt"), tp=2, example_inputs=(models.tokens(2, 16, 0).float(),))
    assert str(err.value) == ("example input idx is a torch.float32 tensor, but the model looks it up in an "
                              "embedding, which takes integer token ids: pass torch.long ids (ids.long())")
    assert err.value.__cause__ is None and err.value.__suppress_context__


def test_token_ids_past_the_vocabulary_are_one_input_error_and_one_cli_line(capsys):
    """Tracing on fake tensors reads no values, so ids past the embedding's rows capture; the model's own forward,
    run to check the capture, then fails: that is the inputs' fault, said in one line (the CLI printed torch's
    IndexError traceback)."""
    model = models.build("gpt")
    too_large = models.tokens(2, 16, 0) + model.transformer.wte.num_embeddings
    with pytest.raises(autotp.InputError, match="own forward fails on the example inputs: IndexError"):
        autotp.plan(model, tp=2, example_inputs=(too_large,))
    assert cli.main(["plan", "examples/train_gpt.py:build_model", "--tp", "2", "--vocab-size", "100000"]) != 0
    err = capsys.readouterr().err
    assert "Traceback" not in err and "--vocab-size at most the model's" in err, err


def test_a_short_attention_mask_and_an_empty_batch_say_so():
    torch.manual_seed(0)
    batch = inputs_workers.padded_batch("right")
    pm = autotp.parallelize(inputs_workers.hf_llama(), tp=1, example_inputs=batch)
    short = dict(batch, attention_mask=batch["attention_mask"][:, :-2])
    with pytest.raises(autotp.InputError, match=r"input attention_mask has 10 at dim 1 but input_ids has 12 at dim 1: "
                                                r"the model was captured with both the same size"):
        pm(**short)
    empty = {k: v[:0] for k, v in batch.items()}
    with pytest.raises(autotp.InputError, match=r"input input_ids is empty \(shape \(0, 12\)\): a batch of no rows"):
        pm.step(**empty)


class _LearnedPositions(torch.nn.Module):
    """A learned position table read as ``pos[:T]``, exactly as long as the example's sequence."""

    def __init__(self, positions: int = 16):
        super().__init__()
        self.tok, self.pos = torch.nn.Embedding(models.VOCAB, 64), torch.nn.Parameter(torch.randn(positions, 64) * 0.02)
        self.norm, self.fc, self.proj = torch.nn.LayerNorm(64), torch.nn.Linear(64, 256), torch.nn.Linear(256, 64)
        self.head = torch.nn.Linear(64, models.VOCAB)

    def forward(self, ids):
        x = self.tok(ids) + self.pos[:ids.shape[1]]
        return self.head(x + self.proj(torch.relu(self.fc(self.norm(x)))))


def test_sequence_parallel_with_a_full_context_example_is_exact():
    torch.manual_seed(0)
    report = autotp.check(_LearnedPositions(16), tp=2, example_inputs=(models.tokens(2, 16, 0),),
                          sequence_parallel=True)
    assert report.exact, str(report)


@pytest.mark.parametrize("field, value, message", [
    ("dim", 0.0, f"field plan.placements['{FC}.weight'].dim must be a whole number, got 0.0 (float)"),
    ("dim", "0", f"field plan.placements['{FC}.weight'].dim must be a whole number, got '0' (str)"),
    ("segments", [-64, 320], f"field plan.placements['{FC}.weight'].segments[0] must be at least 1, got -64"),
])
def test_hand_edited_placement_values_are_one_line(field, value, message, tmp_path, capsys):
    plan = autotp.plan(models.build("gpt"), tp=2, example_inputs=(models.tokens(2, 16, 0),))
    data = json.loads(plan.to_json())
    data["placements"][FC + ".weight"][field] = value
    text = json.dumps(data)
    with pytest.raises(autotp.InputError) as err:
        autotp.Plan.from_json(text)
    assert str(err.value).startswith(f"not a valid autotp plan: {message}")
    path = tmp_path / "edited.json"
    path.write_text(text)
    assert cli.main(["check", GPT, "--plan", str(path)]) == 2
    out = capsys.readouterr().err
    assert out.startswith("autotp: error: ") and out.count("\n") == 1 and message in out, out


class _BiasedTiedHead(torch.nn.Module):
    """An LM head with a bias, its weight tied to the embedding (a speech decoder's ``proj_out``)."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(64, 16)
        self.head = torch.nn.Linear(16, 64)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        return self.head(self.embed(ids))


def test_a_vocab_split_head_with_a_bias_passes_plan_check():
    """Its bias split by the vocabulary as its weight is: the plan autotp made is accepted when given back."""
    torch.manual_seed(0)
    model, ids = _BiasedTiedHead(), torch.randint(0, 64, (2, 8))
    plan = autotp.plan(model, tp=2, example_inputs=ids, vocab="split")
    assert plan.placements["head.bias"].kind == "vocab"
    assert autotp.check(model, example_inputs=ids, plan=plan).exact
