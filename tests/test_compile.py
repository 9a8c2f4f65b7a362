"""``parallelize(..., compile=True)``: the rank graphs run under torch.compile (CPU inductor here), exactly."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

import autotp
from examples.gpt import build_gpt
from tests.distributed import run_on_ranks
from tests.workers import ADAM


def compiled_training(rank: int, world: int) -> float:
    """One compiled tp=world GPT against the unsharded model: the output, then 2 AdamW steps (vocab-parallel
    loss) and every parameter after them; returns the largest parameter error."""
    torch.manual_seed(0)
    ref = build_gpt(n_layer=1, n_head=4, n_embd=32, vocab_size=64, block_size=16)
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randint(0, 64, (2, 8), generator=gen), torch.randint(0, 64, (2, 8), generator=gen)
    pm = autotp.parallelize(ref, tp=world, example_inputs=x, vocab="split", compile=True)
    opt, ref_opt = torch.optim.AdamW(pm.parameters(), **ADAM), torch.optim.AdamW(ref.parameters(), **ADAM)
    for _ in range(2):
        loss = pm.step(x, target=y)
        want = torch.nn.functional.cross_entropy(ref(x).flatten(0, 1), y.flatten())
        want.backward()
        assert_close(loss, want.detach(), rtol=1e-5, atol=1e-6)
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
    pm.eval(), ref.eval()
    with torch.no_grad():
        assert_close(pm(x), ref(x), rtol=1e-5, atol=1e-5)
    full = pm.full_state_dict()
    return max(float((full[k] - v).abs().max()) for k, v in ref.state_dict().items())


def test_compiled_rank_graphs_train_exactly_on_two_ranks():
    assert max(run_on_ranks(compiled_training, 2)) < 1e-5


def test_compile_with_a_pipeline_or_replicas_is_refused_before_anything_runs():
    with pytest.raises(autotp.InputError, match="compile=True runs tensor-parallel graphs"):
        autotp.parallelize(build_gpt(n_layer=1, n_head=2, n_embd=8, vocab_size=16), tp=1, pp=2, compile=True)
