"""Lone column tries judged dead early (passes/dead_ends.py): the region search walks a number of nodes linear in
depth on a mixture-of-experts model, and finds what the full tries find."""

from __future__ import annotations

import sys

import pytest
import torch

import autotp.passes.regions  # noqa: F401  (the module, not the function ``autotp.passes`` re-exports)
from autotp.capture import capture, capture_repeated
from tests import models
from tests.moe_workers import LoopedExperts
from tests.structures_workers import _DECODER, _hf, mixtral

regions = sys.modules["autotp.passes.regions"]
walker = sys.modules["autotp.passes.propagate"]._Walker


def _deepseek(layers: int) -> torch.nn.Module:
    """DeepSeek-V3's blocks (low-rank attention, routed and shared experts) at tiny widths, ``layers`` deep; the
    experts narrower than the model, as DeepSeek-V3's are (so their regions widen and wait: ``regions._widens``)."""
    return _hf("DeepseekV3Config", "DeepseekV3ForCausalLM",
               **(_DECODER | dict(num_key_value_heads=4, num_hidden_layers=layers)), head_dim=16, kv_lora_rank=32,
               q_lora_rank=48, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=4,
               num_experts_per_tok=2, moe_intermediate_size=16, n_shared_experts=1, first_k_dense_replace=1,
               n_group=1, topk_group=1)


def _search(captured, tp: int, early: bool, monkeypatch) -> tuple[str, int, int]:
    """The region search's whole output (as text), how many nodes its walks visited and how many tries it judged
    dead early."""
    visited, dead = [0], [0]
    visit, dead_end = walker.visit, regions.RegionFinder._dead_end

    def counting(self, node):
        visited[0] += 1
        return visit(self, node)

    def judging(self, proj):
        found = early and dead_end(self, proj)
        dead[0] += found
        return found

    with monkeypatch.context() as m:
        m.setattr(walker, "visit", counting)
        m.setattr(regions.RegionFinder, "_dead_end", judging)
        search = captured.analysis.regions(tp)
    return repr((search.regions, search.unmatched)), visited[0], dead[0]


def test_region_search_walks_linearly_in_moe_depth(monkeypatch):
    """Each mixture-of-experts block's down-projections are tried alone as column splits, whose split rides the
    residual stream: walked to the LM head, those tries grow with depth squared (4 more blocks from 8 to 12 cost
    far more than from 4 to 8: 2187, 7683, 16539 nodes visited at 4, 8, 12 layers); judged early, every block
    costs the same (1245, 2545, 3845)."""
    ids = models.tokens(2, 8, 0)
    visits = {}
    for layers in (4, 8, 12):
        captured = capture_repeated(_deepseek(layers), (ids,))
        _, visits[layers], _ = _search(captured, 4, True, monkeypatch)
    _, full, _ = _search(captured, 4, False, monkeypatch)
    first, second = visits[8] - visits[4], visits[12] - visits[8]
    assert abs(second - first) <= 0.05 * first, visits  # linear: each 4 blocks add the same walk
    assert full > 3 * visits[12], (full, visits)  # the full tries walk much further


class _Residual(torch.nn.Module):
    """One projection added into the stream it reads (``h + proj(h)``): its lone try is judged dead at the add, and
    no region claims it later, so its reason is worded at the end (``RegionFinder.explain``), and it is split
    alone by its input features with that reason."""

    def __init__(self):
        super().__init__()
        self.embed, self.proj, self.head = torch.nn.Embedding(64, 32), torch.nn.Linear(32, 32), torch.nn.Linear(32, 64)

    def forward(self, ids):
        h = self.embed(ids)
        return self.head(h + self.proj(h))


_CASES = {"deepseek": (lambda: _deepseek(3), True), "residual": (_Residual, True), "mixtral": (mixtral, False),
          "looped": (LoopedExperts, False)}
"""Name -> (builder, whether some lone try is judged early)."""


@pytest.mark.parametrize("name", sorted(_CASES))
def test_early_verdicts_find_what_the_full_tries_find(name, monkeypatch):
    """The whole region search (every region, every unmatched group with its reason) is the same with the tries
    judged early as with every try walked to its end, at tp=2 and 4."""
    build, judged = _CASES[name]
    captured = capture(build(), (models.tokens(2, 8, 0) % 64,))
    for tp in (2, 4):
        early, _, dead = _search(captured, tp, True, monkeypatch)
        full, _, _ = _search(captured, tp, False, monkeypatch)
        assert early == full
        assert bool(dead) == judged, dead
