"""One tiny model of each structure autotp splits, trained on 2 gloo ranks against the unsharded model.

Mixture-of-experts (a 3-D expert bank), low-rank attention (DeepSeek's MLA) with routed and shared experts,
QK-norm across all heads, interleaved rotary with a parallel block,
encoder-decoders (cross-attention; per-head relative position bias), ``nn.TransformerEncoder``, einsum attention
with a per-head bias picked by ``gather`` and a projection split alone by its input features, and a Mamba
mixer (its depthwise conv1d, scan parameters and time-step projection split by channel).
Outputs, the loss of 3 AdamW steps and every parameter afterwards agree to 1e-5; each structure's matrices
are split (checked in the workers, which name what is split when a check fails).
"""

from __future__ import annotations

from tests import structures_workers
from tests.distributed import run_on_ranks


def test_every_structure_trains_exactly_on_two_ranks():
    results = run_on_ranks(structures_workers.structures, 2)
    assert set(results[0]) == set(structures_workers.CASES)
    for rank in results:
        for label, r in rank.items():
            assert r["loss"] < 1e-5 and r["params"] < 1e-5, (label, r)
            assert r["split"], f"{label}: nothing split"
    for label, r in results[0].items():
        assert r["split"] == results[1][label]["split"], f"{label}: the ranks applied different plans"
