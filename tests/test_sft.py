"""TRL's SFTTrainer on a parallel module: its fused LM head computed from the module's logits
(``runtime.fused_head``), trained exactly as the same SFTTrainer run trains the unsharded model in one process."""

from __future__ import annotations

import pytest

pytest.importorskip("trl")
pytest.importorskip("peft")

from tests import capture_cache, lora_workers, sft_workers
from tests.distributed import run_on_ranks


def test_sft_trainer_with_lora_at_tp_2_trains_as_one_process(tmp_path):
    import torch

    torch.save(sft_workers.reference(), tmp_path / "reference.pt")
    capture_cache.warm(lora_workers.adapted(), sft_workers.example())  # once here, not once per rank
    for result in run_on_ranks(sft_workers.sharded, 2, str(tmp_path)):
        assert result["worst"] < 1e-5, result
        assert result["moved"] > 1e-4, result  # the adapters trained
