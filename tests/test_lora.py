"""LoRA (peft) at tensor and pipeline parallelism: the adapters split at their base layer's communication, found
from the graph (``passes.adapters``), trained exactly, the frozen base left alone."""

from __future__ import annotations

import pytest

pytest.importorskip("peft")

import autotp
from tests import lora_workers, models
from tests.distributed import run_on_ranks

WIDE = 64 * 4
"""Bytes of one (B=2, T=8, 64) activation in float32 divided by B*T: activations are at least this per token."""


def _by_size(events, tokens: int) -> tuple[int, int]:
    """(collectives of activations, of smaller values: weight-gradient shares) among (collective, bytes) events."""
    wide = sum(1 for _, n in events if n >= tokens * WIDE)
    return wide, len(events) - wide


def test_plan_splits_adapters_like_their_base_layers():
    model = lora_workers.adapted(layers=1)
    plan = autotp.plan(model, tp=2, example_inputs=(models.tokens(2, 8, 1),))
    at = "base_model.model.model.layers.0."
    want = {"self_attn.q_proj": ("replicated", "colwise(dim=0)"), "mlp.up_proj": ("replicated", "colwise(dim=0)"),
            "self_attn.o_proj": ("rowwise(dim=1)", "replicated"), "mlp.down_proj": ("rowwise(dim=1)", "replicated")}
    for layer, (a, b) in want.items():
        assert repr(plan.placements[f"{at}{layer}.lora_A.default.weight"]) == a, layer
        assert repr(plan.placements[f"{at}{layer}.lora_B.default.weight"]) == b, layer
    assert not any("split alone" in note for note in plan.notes)  # no adapter is all-reduced on its own


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_checker_exact_at_tp_4(dropout):
    report = autotp.check(lora_workers.adapted(dropout), tp=4, example_inputs=(models.tokens(2, 8, 1),))
    assert report.exact, str(report)


def test_collectives_are_the_base_models_plus_one_small_gradient_sum_per_adapted_layer():
    result = run_on_ranks(lora_workers.collectives, 2)[0]
    adapted, base = result["adapted"], result["base"]
    tokens = 2 * 8
    assert _by_size(adapted["forward"], tokens) == _by_size(base["forward"], tokens)
    assert len(adapted["forward"]) == len(base["forward"])
    wide, small = _by_size(adapted["backward"], tokens)
    # the base is frozen down to the embedding, so no gradient leaves the first layer: its f is not even run
    assert wide == len(base["backward"]) - 1
    print(f"forward {len(adapted['forward'])} (base {len(base['forward'])}); backward {wide} activations + {small} "
          f"weight-gradient sums (base {len(base['backward'])})")
    layers = 2 * len(lora_workers.TARGETS)
    assert small == layers  # each adapter's one whole weight: A on a column split, B on a row split
    assert all(n <= 64 * lora_workers.RANK * 4 * 4 for _, n in adapted["backward"][-small:] if n < tokens * WIDE)


@pytest.mark.parametrize("tp,pp,dropout", [(2, 1, 0.0), (2, 1, 0.1), (2, 2, 0.0)])
def test_adamw_steps_exact_and_frozen_base_untouched(tp, pp, dropout):
    results = run_on_ranks(lora_workers.training, tp * pp, tp, pp, dropout)
    for r in results:
        assert r["worst"] < 1e-5, r
        assert r["moved"] > 1e-4, r  # the adapters trained
        assert r["frozen_params"] > 0 and r["frozen_grads"] == [] and r["frozen_state"] == [], r
        got = [v for v in r["losses"] if v is not None]
        assert got == pytest.approx(r["ref_losses"][:len(got)], rel=1e-5, abs=1e-6) if got else True
    assert any(r["losses"][0] is not None for r in results)


def test_peft_save_load_merge_and_generate(tmp_path):
    result = run_on_ranks(lora_workers.peft_files, 2, str(tmp_path))[0]
    assert (tmp_path / "ours" / "adapter_config.json").is_file()
    assert (tmp_path / "ours" / "adapter_model.safetensors").is_file()
    for what in ("forward", "saved", "loaded", "merged", "merged_weights"):
        assert result[what] < 1e-5, (what, result)
    assert result["generate"], result
