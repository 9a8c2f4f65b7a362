"""Checkpoints and generation under expert parallelism, on 2 gloo ranks against the unsharded model
(``tests/ep_checkpoint_workers.py``): a Mixtral trained at tp=ep=2 and saved as DCP loads, AdamW's state included,
at tp=2 with its experts tensor-split (ep=1) and resumes training exactly; its Hugging Face export (the banks whole, under the model's own names) loads with
``from_pretrained``; ``pm.generate`` at ep equals ``model.generate``."""

from __future__ import annotations

from tests.distributed import run_on_ranks
from tests.ep_checkpoint_workers import across_layouts

TOLERANCE = 1e-5


def test_a_checkpoint_saved_at_ep_loads_at_other_layouts_and_in_hugging_face(tmp_path):
    for r in run_on_ranks(across_layouts, 2, tmp_path):
        assert r["step"] < TOLERANCE and r["saved"] < TOLERANCE, r
        assert r["tp, ep=1 expert split"] == [], r  # loaded into experts split along their matrices, not by expert
        resumed = r["tp, ep=1"]
        assert resumed["loaded"] == 0.0, resumed  # the saved values, bit for bit
        assert resumed["loss"] < TOLERANCE and resumed["params"] < TOLERANCE, resumed
        assert r["from_pretrained"] == 0.0, r
        assert r["generate"], r
