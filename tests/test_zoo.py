"""The zoo: a sample of model types checked here (the full sweep is `autotp zoo`), and the table's coverage."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from devtools import zoo

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = ["llama", "gpt2", "gemma3", "bert:mlm", "longformer:mlm", "t5:seq2seq", "lilt:cls", "bros:tokens",
          "vit:image", "dinov2:backbone", "whisper:speech", "wav2vec2-bert:ctc", "llava:vlm", "nn.TransformerEncoder",
          "examples/gpt.py:build_gpt"]
"""A CI sample of every task group, the cheapest of each the sweep found: decoders (learned positions, a
multimodal config's text model), an encoder, Longformer's chunked sliding windows (once refused at capture on
their data-dependent guards), an encoder-decoder, a document classifier and tagger (token boxes), a
vision tower and a backbone, a speech encoder-decoder, a CTC encoder (refused clearly: in training it draws
SpecAugment masks in numpy), a vision-language model fed text, torch's own, an example; diffusers' and timm's
when installed (they are the ``[zoo]`` extra)."""
OPTIONAL = {"diffusers": "diffusers:DiTTransformer2DModel", "timm": "timm:vit_base_patch16_224"}
DEFAULT_SAMPLE = ["gemma3", "longformer:mlm", "t5:seq2seq", "vit:image"]
"""The part of the sample the default run checks: a decoder (a multimodal config's text model, sliding windows),
windowed attention, an encoder-decoder, a vision tower. The rest of the sample (every other task group) runs with
``-m slow``: Llama, torch's ``nn.TransformerEncoder`` and the example GPT are also trained on gloo ranks by default
(tests/test_parallel.py, tests/test_structures.py)."""


def _swept(names: set[str]) -> dict:
    chosen = zoo.entries(names)
    assert {e.name for e in chosen} == names
    return zoo.sweep(chosen, tps=(2,))


@pytest.fixture(scope="module")
def sample():
    return _swept(set(DEFAULT_SAMPLE))


@pytest.fixture(scope="module")
def rest_of_sample():
    import importlib.util

    optional = {name for package, name in OPTIONAL.items() if importlib.util.find_spec(package)}
    return _swept((set(SAMPLE) | optional) - set(DEFAULT_SAMPLE))


def _never_silently_wrong(results: dict) -> None:
    for name, runs in results.items():
        result = runs[2]
        assert result.status not in (zoo.Status.MISMATCH, zoo.Status.CRASH), f"{name}: {result.notes}"
        assert result.status is not zoo.Status.NOT_BUILDABLE, f"{name}: {result.notes}"


def test_sample_is_never_silently_wrong(sample):
    _never_silently_wrong(sample)


@pytest.mark.slow
def test_the_rest_of_the_sample_is_never_silently_wrong(rest_of_sample):
    _never_silently_wrong(rest_of_sample)


@pytest.mark.slow
def test_the_sample_has_every_task_group(sample, rest_of_sample):
    families = {e.name: e.family for e in zoo.entries()}
    assert set(families.values()) == {families[name] for name in {*sample, *rest_of_sample}}


def test_sample_splits_the_decoders_and_windowed_attention(sample):
    for name in ("gemma3", "longformer:mlm"):
        assert sample[name][2].status is zoo.Status.EXACT, (name, sample[name][2].notes)


@pytest.mark.slow
def test_the_rest_of_the_sample_splits_llama(rest_of_sample):
    assert rest_of_sample["llama"][2].status is zoo.Status.EXACT, rest_of_sample["llama"][2].notes


def test_coverage_table_lists_every_causal_lm_type():
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    table = (ROOT / "docs" / "COVERAGE.md").read_text(encoding="utf-8")
    listed = set(re.findall(r"^\| `([^`]+)` \|", table, flags=re.M))
    missing = sorted(set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES) - listed)
    assert not missing, f"docs/COVERAGE.md lacks {missing[:10]}: run `autotp zoo`"
    statuses = re.findall(r"^\| `[^`]+` \| ([^|]+) \|", table, flags=re.M)
    assert statuses and set(s.strip() for s in statuses) <= {s.value for s in zoo.Status}
    for group in ("causal-lm", "masked-lm", "seq2seq-lm", "image-classification", "ctc", "image-text-to-text"):
        assert f"## {group}" in table, f"docs/COVERAGE.md has no {group} group"


def test_every_task_group_has_entries():
    families = {e.family for e in zoo.entries()}
    assert {"causal-lm", "masked-lm", "seq2seq-lm", "sequence-classification", "token-classification",
            "image-classification", "backbone", "speech-seq2seq", "ctc", "image-text-to-text", "torch",
            "example"} <= families


def test_saved_results_make_the_same_table(tmp_path):
    from devtools.zoo_table import coverage_table, load_results, save_results

    results = {"a": {2: zoo.Result(zoo.Status.EXACT, 1.0)}, "b:mlm": {2: zoo.Result(zoo.Status.NOT_BUILDABLE,
                                                                                   notes=["ValueError: x"])}}
    families = {"a": "causal-lm", "b:mlm": "masked-lm"}
    save_results(tmp_path / "r.json", results, families)
    loaded, loaded_families = load_results([tmp_path / "r.json"])
    table = coverage_table(loaded, loaded_families, tps=(2,))
    assert table == coverage_table(results, families, tps=(2,))
    assert "| causal-lm | 1 | 1 exact — 1/1 (100%) of the buildable exact |" in table


def test_a_sample_with_sequence_parallelism_is_never_silently_wrong():
    """ProphetNet concatenates its streams along the sequence: it was the one wrong row of the sweep with
    ``--sequence-parallel`` before such values were kept whole."""
    chosen = zoo.entries({"prophetnet", "phi", "nn.TransformerEncoder"})
    results = zoo.sweep(chosen, tps=(2,), sequence_parallel=True)
    for name, runs in results.items():
        assert runs[2].status not in (zoo.Status.MISMATCH, zoo.Status.CRASH), f"{name}: {runs[2].notes}"
    assert results["nn.TransformerEncoder"][2].status is zoo.Status.REFUSED  # no token ids: nothing to split along


def test_a_missing_optional_library_is_the_reason_in_one_line():
    from devtools.zoo_entries import build_reason

    message = "\nDinatBackbone requires the natten library but it was not found in your environment. You can ...\n"
    assert build_reason(ImportError(message)) == "needs the natten library, not installed"
    assert build_reason(ModuleNotFoundError("no module", name="detectron2")) == \
        "needs the detectron2 library, not installed"
    assert build_reason(ValueError("bad\nconfig")) == "ValueError: bad config"
    from importlib.metadata import PackageNotFoundError

    missing = PackageNotFoundError("The 'requests' distribution was not found and is required by this application")
    assert build_reason(missing) == "needs the requests library, not installed"


def test_a_document_model_is_fed_a_valid_box_per_token():
    from torch import nn

    from devtools.zoo_inputs import document_inputs

    class Document(nn.Module):
        def __init__(self):
            super().__init__()
            self.tokens = nn.Embedding(64, 8)

        def forward(self, input_ids, bbox=None):
            return self.tokens(input_ids)

    inputs = document_inputs(Document())
    ids, boxes = inputs["input_ids"], inputs["bbox"]
    assert boxes.shape == (*ids.shape, 4) and bool((boxes[..., 2:] > boxes[..., :2]).all()) and boxes.max() <= 1000


def test_a_vision_language_model_is_fed_what_its_forward_asks_for():
    """Text alone where the forward runs on it (with each token's type where it takes one); images (grouped per
    sample where flat ones fail) where it refuses text alone; a required Q-Former's ids as the token ids."""
    from types import SimpleNamespace

    import torch
    from torch import nn

    from devtools.zoo_inputs import vision_text_inputs

    config = SimpleNamespace(vocab_size=64, image_size=8, num_channels=3, is_encoder_decoder=False)

    class TextOnly(nn.Module):
        main_input_name = "input_ids"

        def __init__(self):
            super().__init__()
            self.config, self.tokens = config, nn.Embedding(64, 8)

        def forward(self, input_ids, pixel_values=None):
            return self.tokens(input_ids)

    class NeedsGroupedImages(TextOnly):
        def forward(self, input_ids, pixel_values=None, image_attention_mask=None):
            if pixel_values is None:
                raise ValueError("You have to specify pixel_values")
            batch, images, channels, height, width = pixel_values.shape  # one group of images per sample
            return self.tokens(input_ids) * image_attention_mask[..., :1]

    class QFormer(TextOnly):
        def forward(self, pixel_values, qformer_input_ids, input_ids=None):
            return self.tokens(qformer_input_ids) + pixel_values.mean()

    class TypedTokens(TextOnly):
        def forward(self, input_ids, pixel_values=None, token_type_ids=None):
            return self.tokens(input_ids)

    assert isinstance(vision_text_inputs(TextOnly()), tuple)
    typed = vision_text_inputs(TypedTokens())  # trained with each token's type, as PaliGemma is
    assert set(typed) == {"input_ids", "token_type_ids"} and not typed["token_type_ids"].any()
    grouped = vision_text_inputs(NeedsGroupedImages())
    assert grouped["pixel_values"].shape[1:] == (1, 3, 8, 8) and "image_attention_mask" in grouped
    queried = vision_text_inputs(QFormer())
    assert torch.equal(queried["qformer_input_ids"], queried["input_ids"]) and queried["pixel_values"].dim() == 4


def test_the_time_limit_counts_cpu_time_with_a_clock_backstop():
    import time

    start = time.process_time()
    with pytest.raises(TimeoutError) as stopped, zoo._TimeLimit(0.25):
        while True:  # busy: CPU time runs out first, unless a loaded machine gives it under a quarter of a core
            pass
    assert "of CPU time" in str(stopped.value) or time.process_time() - start < 0.25, stopped.value
    with pytest.raises(TimeoutError, match="by the clock"), zoo._TimeLimit(0.25):
        time.sleep(5)  # waiting uses no CPU time: the clock's limit, WALL_FACTOR times as long, stops it


def test_audio_features_are_sized_by_the_encoder_sub_config_where_the_config_has_none():
    from types import SimpleNamespace

    from devtools.zoo_inputs import _features

    model = SimpleNamespace(config=SimpleNamespace(encoder_config=SimpleNamespace(num_mel_bins=16)))
    assert _features(model).shape[-1] == 16


def test_a_convolution_over_the_inputs_is_the_only_one_excused():
    """A patch embedding reads pixels (no parameter before it): Megatron keeps it whole too. A convolution
    inside the network (after the stem) is real compute kept whole, and stays counted."""
    import torch

    from autotp.checker import prepare

    class Stem(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.stem, self.body = torch.nn.Conv2d(3, 16, 4, stride=4), torch.nn.Conv2d(16, 16, 3, padding=1)

        def forward(self, x):
            return self.body(self.stem(x * 2.0)).flatten(1)

    captured = prepare(Stem(), (torch.randn(2, 3, 16, 16),)).captured
    assert zoo.input_convolutions(captured) == {"stem.weight"}


def test_tables_joined_to_the_activations_are_told_from_matrices():
    """A position table added and a class token put before the tokens (Megatron keeps such tables whole) are
    excused; a matrix the forward multiplies by, and a bias, are not."""
    import torch

    from autotp.checker import prepare

    class Tokens(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.pos, self.cls = torch.nn.Parameter(torch.randn(1, 16, 64)), torch.nn.Parameter(torch.randn(1, 1, 64))
            self.proj, self.mix = torch.nn.Linear(64, 64), torch.nn.Parameter(torch.randn(64, 64))

        def forward(self, x):
            x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x + self.pos[:, : x.shape[1]]], 1)
            return self.proj(x) @ self.mix.t()

    assert zoo.added_tables(prepare(Tokens(), (torch.randn(2, 16, 64),)).captured) == {"pos", "cls"}


def test_a_table_of_a_sweep_stopped_early_counts_only_what_ran():
    from devtools.zoo_table import coverage_table

    results = {"a": {2: zoo.Result(zoo.Status.EXACT, 1.0)}, "b": {2: zoo.Result(zoo.Status.PENDING)}}
    table = coverage_table(results, {"a": "causal-lm", "b": "causal-lm"}, tps=(2,))
    assert "| causal-lm | 2 | 1 exact — 1/1 (100%) of the buildable exact (1 pending) |" in table
    assert "| `b` | pending |" in table


def test_a_decoder_over_codebooks_is_fed_a_row_per_codebook():
    """MusicGen's decoder embeds each of its codebooks' rows with its own table and reads batch x codebooks rows:
    synthesised ids have that many rows (and its forward runs on them); a text decoder beside codebooks (Moshi's,
    one table) gets one row per sample."""
    import torch

    from autotp.capture.core.examples import EXAMPLE_BATCH, synthesise

    built = {e.name: e.build() for e in zoo.entries({"musicgen", "moshi"})}
    (ids,) = synthesise(built["musicgen"]).flat
    assert ids.shape[0] == EXAMPLE_BATCH * built["musicgen"].config.num_codebooks
    with torch.no_grad():
        built["musicgen"](ids)
    assert synthesise(built["moshi"]).flat[0].shape[0] == EXAMPLE_BATCH


def test_composite_configs_build_their_causal_lm():
    """Types whose causal LM takes one part of a composite config (text or decoder), whose default leaves a field
    unset (DBRX's query clipping, LFM2-MoE's layer kinds), or whose vision tower no config field shrinks (Gemma 3n's
    timm MobileNet) build tiny."""
    import torch

    from devtools.tiny import MAX_PARAMS

    import importlib.util

    names = {"llama4", "dbrx", "lfm2_moe"}
    if importlib.util.find_spec("timm") is not None:  # Gemma 3n's tower is timm's: not in the test install
        names.add("gemma3n")
    for entry in zoo.entries(names):
        model = entry.build()
        assert sum(p.numel() for p in model.parameters()) < MAX_PARAMS, entry.name
        with torch.no_grad():
            model(*entry.inputs(model))


def test_a_model_that_runs_only_with_as_many_key_value_heads_as_heads_is_built_so():
    """Moonshine's attention views its queries by the key-value head count and Granite Speech 5's never repeats its
    key-value heads: each builds from the tiny config with fewer, and fails only when run. The zoo's build runs the
    model and falls back to as many key-value heads as heads (its default config's)."""
    import torch

    for entry in zoo.entries({"moonshine:speech", "granite_speech5_ctc:ctc"}):
        model = entry.build()
        config = getattr(model.config, "encoder_config", model.config)
        heads = ("encoder_num_attention_heads", "encoder_num_key_value_heads") if hasattr(
            config, "encoder_num_key_value_heads") else ("num_attention_heads", "num_key_value_heads")
        assert getattr(config, heads[0]) == getattr(config, heads[1]), entry.name
        with torch.no_grad():
            inputs = entry.inputs(model)
            model(**inputs) if isinstance(inputs, dict) else model(*inputs)


def test_audio_features_are_as_wide_as_the_first_projection_reads_them():
    """A front end that stacks mel frames before its first projection (Granite Speech 5's reads four mel bins'
    worth per frame) names that width in no config field: the projection's refusal states it."""
    import torch
    from types import SimpleNamespace

    from devtools.zoo_inputs import audio_inputs

    class Stacked(torch.nn.Module):
        main_input_name = "input_features"

        def __init__(self):
            super().__init__()
            self.config = SimpleNamespace(num_mel_bins=16)
            self.input_linear = torch.nn.Linear(4 * 16, 32)

        def forward(self, input_features):
            return self.input_linear(input_features)

    features = audio_inputs(Stacked())["input_features"]
    assert features.shape[-1] == 64


def test_a_model_that_fails_in_its_own_code_is_named_at_the_line(tmp_path):
    from devtools.zoo_entries import build_reason

    source = tmp_path / "models" / "toy" / "modeling_toy.py"
    source.parent.mkdir(parents=True)
    source.write_text("def forward(outputs):\n    return outputs.image_outputs\n")
    namespace: dict = {}
    exec(compile(source.read_text(), str(source), "exec"), namespace)
    try:
        namespace["forward"](object())
    except AttributeError as e:
        reason = build_reason(e)
    assert reason == ("AttributeError: 'object' object has no attribute 'image_outputs' "
                      "(raised by the model's own code, modeling_toy.py:2)")


def test_full_context_entries_read_their_position_tables_whole():
    """``--full-context``: a table exactly as long as the example (OpenAI GPT's, with its causal-mask buffer), or
    as short as the model allows (RoBERTa's positions start after its padding index), and sequence parallelism
    exact there."""
    from autotp.capture.core.examples import EXAMPLE_SEQ

    gpt, roberta = sorted(zoo.entries({"openai-gpt", "roberta"}, at_full_context=True), key=lambda e: e.name)
    assert gpt.build().transformer.positions_embed.num_embeddings == EXAMPLE_SEQ
    assert roberta.build().roberta.embeddings.position_embeddings.num_embeddings == EXAMPLE_SEQ + 2
    result = zoo.run_entry(gpt, 2, sequence_parallel=True)
    assert result.status is zoo.Status.EXACT, result.notes
