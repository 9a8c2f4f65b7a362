"""Sequence parallelism at full context: causal-mask buffers and position tables sliced to the sequence
(``mask[:T, :T]``, ``pos[:T]``, GPT-2's ``bias[:, :, :T, :T]``, an embedding read with ``arange(T)``) with an
example exactly as long as them, the usual training shape, and shorter; each against the unsharded model."""

from __future__ import annotations

import pytest
import torch

import autotp
from autotp.capture import capture
from autotp.capture.core.dynamic import fixed_dims, refused_sizes
from tests import models, sequence_workers
from tests.distributed import run_on_ranks
from tests.full_context_models import HF_NAMES, POSITIONS, OddLM, hf_model


def test_a_capture_as_long_as_the_tables_keeps_the_sequence_dynamic():
    """torch's layout probe on ``mask[:T, :T]`` (is a T x T slice of a 16 x 16 buffer contiguous?) guards
    T == 16 at a 16-token example; the capture traces again without it, so T stays a symbol."""
    torch.manual_seed(0)
    ids = models.tokens(2, POSITIONS, 0)
    captured = capture(OddLM(), (ids,))
    assert fixed_dims(captured.module, (ids,)) == 0
    assert sorted(captured.dim_names.values()) == ["B", "T"]


def test_a_capture_shorter_than_the_tables_takes_them_whole_too():
    """At a shorter example the same probe guards T != 16: the module would refuse full context. The second trace
    drops that guard (checked on meta tensors: the module's input guards accept 16 tokens)."""
    torch.manual_seed(0)
    short = models.tokens(2, POSITIONS // 2, 0)
    captured = capture(OddLM(), (short,))
    assert refused_sizes(captured.module, (short,), ((0, 1, POSITIONS),)) == 0
    assert refused_sizes(captured.module, (short,), ((0, 1, POSITIONS + 1),)) == 1  # longer than the table


@pytest.mark.parametrize("positions, mask, seq", [("param", "2d", POSITIONS), ("param", "2d", POSITIONS // 2),
                                                  ("embedding", "4d", POSITIONS), ("param", "4d", POSITIONS)])
def test_sequence_parallel_with_tables_sliced_to_the_sequence_is_exact(positions, mask, seq):
    torch.manual_seed(0)
    report = autotp.check(OddLM(positions, mask, dropout=0.1), 2, models.tokens(2, seq, 0), vocab="split",
                          sequence_parallel=True)
    assert report.exact and report.plan.sequence_parallel, str(report)
    # split as Megatron splits it: heads (QKV by columns, the output by rows) and the MLP, in both blocks
    assert [(r.kind.value, r.columns) for r in report.plan.regions if r.kind.value in ("attention", "mlp")] == [
        ("attention", ("blocks.0.qkv",)), ("mlp", ("blocks.0.up",)), ("attention", ("blocks.1.qkv",)),
        ("mlp", ("blocks.1.up",))]


@pytest.mark.parametrize("name", HF_NAMES)
def test_hugging_face_decoders_at_full_context_are_exact(name):
    """GPT-2 (position table, ``arange`` ids), OpenAI GPT (a ``position_ids`` buffer sliced, a 4-d mask buffer),
    GPT-Neo (global and windowed mask buffers), OPT (offset learnt positions), Llama (rotary) at the table's length."""
    torch.manual_seed(0)
    report = autotp.check(hf_model(name), 2, models.tokens(2, POSITIONS, 0), vocab="split", sequence_parallel=True)
    assert report.exact and report.plan.sequence_parallel, str(report)


class _WholeTable(torch.nn.Module):
    """A position table added whole (``x + pos``): the model itself takes only sequences of its length."""

    def __init__(self):
        super().__init__()
        self.tok, self.pos = torch.nn.Embedding(models.VOCAB, 64), torch.nn.Parameter(torch.zeros(POSITIONS, 64))
        self.up, self.down = torch.nn.Linear(64, 128), torch.nn.Linear(128, 64)

    def forward(self, ids):
        x = self.tok(ids) + self.pos
        return x + self.down(torch.relu(self.up(x)))


def test_a_sequence_the_model_itself_fixes_is_still_refused():
    """The second trace frees only what a layout probe fixed: a table added whole fixes T in the model's own
    arithmetic, and sequence parallelism says so."""
    with pytest.raises(autotp.PlanError, match="no such ids with a dynamic sequence length"):
        autotp.plan(_WholeTable(), 2, models.tokens(2, POSITIONS, 0), sequence_parallel=True)


def test_full_context_trains_exactly_on_two_ranks():
    for rank in run_on_ranks(sequence_workers.full_context_training, 2):
        assert set(rank) == {"param/2d", "gpt_neo", "param/2d captured short"}
        for label, errors in rank.items():
            assert errors["plan"], label
            assert errors["loss"] < 1e-5 and errors["params"] < 1e-5, (label, errors)
            assert errors["longer"].startswith("InputError: these inputs' sizes are outside"), (label, errors)
