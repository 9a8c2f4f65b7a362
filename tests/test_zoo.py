"""The zoo: a sample of model types checked here (the full sweep is `autotp zoo`), and the table's coverage."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from autotp.tools import zoo

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = ["llama", "gpt2", "opt", "qwen2", "mistral", "gemma", "phi", "bert", "t5:seq2seq", "nn.TransformerEncoder"]
"""A CI sample: decoder families (learned positions, padding rows, GQA), an encoder, an encoder-decoder, torch."""


@pytest.fixture(scope="module")
def sample():
    chosen = zoo.entries(set(SAMPLE))
    assert {e.name for e in chosen} == set(SAMPLE)
    return zoo.sweep(chosen, tps=(2,))


def test_sample_is_never_silently_wrong(sample):
    for name, runs in sample.items():
        result = runs[2]
        assert result.status not in (zoo.Status.MISMATCH, zoo.Status.CRASH), f"{name}: {result.notes}"
        assert result.status is not zoo.Status.NOT_BUILDABLE, f"{name}: {result.notes}"


def test_sample_splits_the_decoders(sample):
    for name in ("llama", "qwen2", "mistral"):
        assert sample[name][2].status is zoo.Status.EXACT, (name, sample[name][2].notes)


def test_coverage_table_lists_every_causal_lm_type():
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    table = (ROOT / "docs" / "COVERAGE.md").read_text(encoding="utf-8")
    listed = set(re.findall(r"^\| `([^`]+)` \|", table, flags=re.M))
    missing = sorted(set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES) - listed)
    assert not missing, f"docs/COVERAGE.md lacks {missing[:10]}: run `autotp zoo`"
    statuses = re.findall(r"^\| `[^`]+` \| [^|]+ \| ([^|]+) \|", table, flags=re.M)
    assert set(s.strip() for s in statuses) <= {s.value for s in zoo.Status}


def test_a_sample_with_sequence_parallelism_is_never_silently_wrong():
    """ProphetNet concatenates its streams along the sequence: it was the one wrong row of the sweep with
    ``--sequence-parallel`` before such values were kept whole."""
    chosen = zoo.entries({"prophetnet", "phi", "nn.TransformerEncoder"})
    results = zoo.sweep(chosen, tps=(2,), sequence_parallel=True)
    for name, runs in results.items():
        assert runs[2].status not in (zoo.Status.MISMATCH, zoo.Status.CRASH), f"{name}: {runs[2].notes}"
    assert results["nn.TransformerEncoder"][2].status is zoo.Status.REFUSED  # no token ids: nothing to split along
