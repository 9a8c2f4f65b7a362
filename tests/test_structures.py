"""One tiny model of each structure autotp splits, trained on 2 gloo ranks against the unsharded model.

Mixture-of-experts (a 3-D expert bank), low-rank attention (DeepSeek's MLA) with routed and shared experts,
QK-norm across all heads, interleaved rotary with a parallel block,
encoder-decoders (cross-attention; per-head relative position bias; ``nn.Transformer`` with a causal mask, its
cross-attention's packed projections sliced), ``nn.TransformerEncoder``, einsum attention
with a per-head bias picked by ``gather`` and a projection split alone by its input features, and a Mamba
mixer (its depthwise conv1d, scan parameters and time-step projection split by channel), and convolutions split by
channels (a conv1d pair, a ResNet bottleneck and an inverted residual, with batch norms in training and a group
norm).
The workers measure; this test asserts: outputs, the loss of 2 AdamW steps and every parameter afterwards agree
to 1e-5 (relative, beyond it: 0), each structure's matrices named in its case are split, and both ranks applied
the same plan.
"""

from __future__ import annotations

import torch

from tests import capture_cache, structures_workers
from tests.distributed import run_on_ranks

ERROR = 1e-5


def _warm() -> None:
    """Each case's model captured here, as ``check_case`` builds it, before the ranks are forked: they find the
    captures made instead of each making them (half the CPU time on a busy machine)."""
    for case in structures_workers.CASES.values():
        torch.manual_seed(structures_workers.SEED)
        capture_cache.warm(case.build(), case.inputs(2, case.example_seq, 1))


def test_every_structure_trains_exactly_on_two_ranks():
    _warm()
    results = run_on_ranks(structures_workers.structures, 2)
    assert set(results[0]) == set(structures_workers.CASES)
    for rank in results:
        for label, r in rank.items():
            assert r["output"] < ERROR, f"{label}: output off by {r['output']:.2e} (split: {r['split']})"
            assert max(r["losses"]) < ERROR, f"{label}: losses off by {r['losses']}"
            worst = max(r["params"], key=r["params"].get)
            assert r["params"][worst] < ERROR, f"{label}: {worst} off by {r['params'][worst]:.2e} after 2 AdamW steps"
            assert not r["missing_keys"], f"{label}: full_state_dict lacks {r['missing_keys']}"
            kept = sorted(set(r["must_split"]) - set(r["split"]))
            assert not kept, f"{label}: {kept} kept whole; split: {r['split']}"
    for label, r in results[0].items():
        assert r["split"] == results[1][label]["split"], f"{label}: the ranks applied different plans"
