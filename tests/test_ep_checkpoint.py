"""Checkpoints and generation under expert parallelism, on 2 gloo ranks against the unsharded model
(``tests/ep_checkpoint_workers.py``): a Mixtral trained at tp=ep=2 and saved as DCP loads, AdamW's state included,
at tp=2 with its experts tensor-split (ep=1) and resumes training exactly; its Hugging Face export (the banks whole, under the model's own names) loads with
``from_pretrained``; ``pm.generate`` at ep equals ``model.generate``. Above tp (experts divided over data-parallel
ranks) a checkpoint records each bank by the experts a rank holds, so it loads at tp with the experts
tensor-split and back, and (4 ranks, slow) at ep=4, ep=2 and ep=1."""

from __future__ import annotations

from tests.distributed import run_on_ranks
import pytest

from tests.ep_checkpoint_workers import across_layouts, through_layouts

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


def _through(world: int, layouts: list, tmp_path) -> None:
    """Every layout of ``layouts`` loads the previous one's checkpoint bit for bit and steps like the unsharded
    model, holding E/ep experts per rank (all 4 of them, tensor-split, where ep=1)."""
    for rank in run_on_ranks(through_layouts, world, tmp_path, layouts):
        for at, row in enumerate(rank):
            ep = row["layout"][2]
            assert at == 0 or row["loaded"] == 0.0, row
            assert row["loss"] < TOLERANCE and row["params"] < TOLERANCE, row
            assert row["local_experts"] == [4 // ep], row


def test_a_checkpoint_saved_at_ep_above_tp_loads_at_tp_and_back(tmp_path):
    """tp=1 x dp=2 at ep=2 (each replica 2 of the 4 experts) -> tp=2 with the experts tensor-split -> ep=2 again
    under fsdp (the dense layers sharded over the replicas, the experts whole on their ranks), AdamW's state
    carried through, every step equal to the unsharded model's."""
    _through(2, [(1, 2, 2), (2, 1, 1), (1, 2, 2, "fsdp")], tmp_path)


@pytest.mark.slow  # about 3 minutes on 2 cores
def test_a_checkpoint_saved_at_ep_4_loads_at_ep_2_at_tp_2_and_back_on_four_ranks(tmp_path):
    """tp=2 x dp=2: ep=4 (one expert a rank) -> ep=2 -> ep=1 (the experts tensor-split) -> tp=1 x dp=4 at ep=2
    under fsdp (each expert on two ranks, its gradient summed over them)."""
    _through(4, [(2, 2, 4), (2, 2, 2), (2, 2, 1), (1, 4, 2, "fsdp")], tmp_path)
