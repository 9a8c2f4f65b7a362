"""Context parallelism through reshapes that merge the sequence with other dims (GPT-2's ``Conv1D`` views
``[B, T, C]`` as ``[B*T, C]`` around its ``addmm``; a loss flattens its logits): where the merged dim holds the
sequence (``passes.sequence_merge.view_split``), that GPT-2's layers then compute each rank's tokens only, and that
it trains exactly on gloo with less saved for backward (``test_context_explicit``'s gloo run, and
``test_context_parallel``'s GPT-2 over a padded batch)."""

from __future__ import annotations

import sympy
import torch

from autotp.capture import capture
from autotp.planning.context_plan import plan_context
from passes.sequence_merge import view_split
from tests import context_workers, models

B, T, C, H = sympy.symbols("B T C H", positive=True, integer=True)


def test_view_split_follows_the_sequence_into_and_out_of_a_merged_dim():
    assert view_split((B, T, C), 1, (1, 1), (B * T, C), T) == (0, (B, 1))  # Conv1D's flatten
    assert view_split((B * T, 3 * C), 0, (B, 1), (B, T, 3 * C), T) == (1, (1, 1))  # and back
    assert view_split((B, T, H, 16), 1, (1, 1), (B, T * H, 16), T) == (1, (1, H))  # sequence outer, heads inner
    assert view_split((B, T, C), 1, (1, 1), (B * T * C,), T) == (0, (B, C))
    assert view_split((B, T, C), 1, (1, 1), (B, T / 2, 2 * C), T) is None  # the sequence cut across two dims
    assert view_split((B * T, C), 0, (B, 1), (B * C, T), T) is None  # not where the merged dim put it


def test_gpt2s_layers_compute_each_ranks_tokens():
    """Every Conv1D product (``addmm``) of GPT-2 is split along the sequence, both attentions exchange keys and
    values, and nothing but the loss reads across positions."""
    c = capture(context_workers.gpt2(), (models.tokens(2, 16, 1),), training=True)
    layout = plan_context(c, 2)
    addmms = [n.name for n in c.module.graph.nodes if n.target is torch.ops.aten.addmm.default]
    assert len(addmms) == 8 and all(name in layout.split and name in layout.merged for name in addmms)
    assert layout.attention == 2 and len(layout.kv) == 4
    assert all("cross_entropy" in op for op in layout.crossing), layout.crossing
