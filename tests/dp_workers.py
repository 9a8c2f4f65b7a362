"""Per-rank bodies of the data-parallel tests: dp replicas (x tp x pp) against one process on the global batch."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.testing import assert_close

import autotp
from bench.ranks import reform_world
from tests import models
from tests.workers import ADAM, STEPS

BATCH, SEQ = 8, 12
"""The global batch: each of 2 replicas takes 4 rows; with pp=2, 2 microbatches of 2."""
MAX_NORM = 0.5
"""Below the tiny GPT's gradient norm (about 2), so clipping scales every step."""


def _mean_over_replicas(loss: torch.Tensor, dp_rank: int) -> float:
    """The mean of the replicas' losses (every rank of a replica holds the same loss)."""
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (dp_rank, loss.item()))
    per_replica = dict(everyone)
    return sum(per_replica.values()) / len(per_replica)


def check_data_parallel(dp: int, tp: int, pp: int, mode: str, sequence_parallel: bool = False,
                        recompute: str = "none") -> dict:
    """STEPS AdamW steps with clipping on dp replicas, each on its slice, against one process on the whole batch:
    outputs, the mean loss, the clipped norm (2-norm and inf-norm), eval-mode outputs and every parameter after."""
    label = f"dp={dp} tp={tp} pp={pp} {mode} recompute={recompute}" + (" sequence parallel" if sequence_parallel else "")
    ref = models.build("gpt", layers=1)
    pm = autotp.parallelize(ref, tp=tp, pp=pp, dp=dp, dp_mode=mode, example_inputs=(models.tokens(2, 16, seed=1),),
                            microbatches=2 if pp > 1 else None, sequence_parallel=sequence_parallel,
                            recompute=recompute)
    assert (pm.dp_size, 0 <= pm.dp_rank < dp) == (dp, True), label
    x, y = models.tokens(BATCH, SEQ, seed=2), models.target_for("gpt", BATCH, SEQ, seed=3)
    rows = slice(pm.dp_rank * BATCH // dp, (pm.dp_rank + 1) * BATCH // dp)
    assert_close(pm(x[rows]), ref(x[rows]), rtol=1e-5, atol=1e-6, msg=lambda m: f"{label} output: {m}")
    opt, ref_opt = torch.optim.AdamW(pm.parameters(), **ADAM), torch.optim.AdamW(ref.parameters(), **ADAM)
    norms = []
    for step in range(STEPS):
        loss = pm.step(x[rows], target=y[rows], loss_fn=models.loss_fn)
        ref_loss = models.loss_fn(ref(x), y)
        ref_loss.backward()
        mean = _mean_over_replicas(loss, pm.dp_rank)
        assert math.isclose(mean, ref_loss.item(), rel_tol=1e-5), f"{label} step {step}: {mean} vs {ref_loss.item()}"
        if step == 0:  # the inf-norm, with nothing clipped (max_norm far above it)
            got = pm.clip_grad_norm_(1e9, math.inf)
            want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e9, math.inf)
            assert_close(got, want, rtol=1e-5, atol=0, msg=lambda m: f"{label} inf-norm: {m}")
        norm, ref_norm = pm.clip_grad_norm_(MAX_NORM), torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM)
        assert_close(norm, ref_norm, rtol=1e-5, atol=0, msg=lambda m: f"{label} step {step} norm: {m}")
        # After clipping, the norm is max_norm on both sides: every rank scaled its pieces alike.
        after = pm.clip_grad_norm_(1e9)
        assert_close(after, torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e9), rtol=1e-5, atol=0,
                     msg=lambda m: f"{label} step {step} norm after clipping: {m}")
        norms.append(norm.item())
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
    pm.eval(), ref.eval()  # the eval-mode graphs read the same (sharded, trained) parameters
    assert_close(pm(x[rows]), ref(x[rows]), rtol=1e-5, atol=1e-5, msg=lambda m: f"{label} eval output: {m}")
    full = pm.full_state_dict()
    assert set(full) == set(ref.state_dict()), label
    for key, want in ref.state_dict().items():
        assert_close(full[key], want, rtol=1e-5, atol=1e-5, msg=lambda m: f"{label} {key} after AdamW: {m}")
    return {"norms": norms, "local_params": sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel()
                                                for p in pm.parameters()),
            "total_params": sum(p.numel() for p in ref.parameters())}


def check_layouts(rank: int, world: int, configs: list[list]) -> dict:
    """``check_data_parallel`` for each (dp, tp, pp, mode), the largest worlds first: a config needing fewer
    ranks than were spawned re-forms the default group from the first ranks (the rest stop)."""
    results = {}
    for dp, tp, pp, mode in sorted(configs, key=lambda c: -c[0] * c[1] * c[2]):
        if not reform_world(dp * tp * pp, "cpu"):
            break
        results[f"dp={dp} tp={tp} pp={pp} {mode}"] = check_data_parallel(dp, tp, pp, mode)
    return results
