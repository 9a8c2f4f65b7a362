"""Data parallelism, the third axis: dp replicas (x tp x pp) train exactly like one process on the global batch.

One 8-rank spawn checks every layout (the 4-rank ones re-form the group from the first four ranks); the
multi-node test starts two torchrun "nodes" on this machine.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import autotp
from autotp.runtime.process import check_world
from bench.ranks import free_port
from tests import capture_cache, dp_workers, models
from tests.distributed import run_on_ranks

ROOT = Path(__file__).resolve().parent.parent
LAYOUTS = [(2, 2, 1), (2, 1, 2), (2, 2, 2)]
"""(dp, tp, pp)."""
MODES = ["fsdp", "replicate"]


@pytest.fixture(scope="module")
def layouts():
    configs = [[dp, tp, pp, mode] for dp, tp, pp in LAYOUTS for mode in MODES]
    # Captured here once: 8 ranks on 2 cores would otherwise capture it four times per core
    capture_cache.warm(models.build("gpt", layers=1), (models.tokens(2, 16, seed=1),))
    return run_on_ranks(dp_workers.check_layouts, 8, configs)[0]


def test_every_layout_and_mode_trains_like_one_process(layouts):
    """The worker asserted outputs, losses, norms and parameters; here: every config ran to the end."""
    assert sorted(layouts) == sorted(f"dp={dp} tp={tp} pp={pp} {m}" for dp, tp, pp in LAYOUTS for m in MODES)
    # Clipping was active: each step's norm is above max_norm, so clip_grad_norm_ scaled the gradients.
    assert all(n > dp_workers.MAX_NORM for r in layouts.values() for n in r["norms"]), layouts


def test_fsdp_shards_what_replicate_holds_whole(layouts):
    for dp, tp, pp in LAYOUTS:
        sharded, whole = (layouts[f"dp={dp} tp={tp} pp={pp} {m}"]["local_params"] for m in MODES)
        # FSDP gives each replica ceil(rows / dp) rows of every tensor (the last ones fewer): 1/dp up to rounding.
        assert sharded == pytest.approx(whole / dp, rel=0.02), (dp, tp, pp, sharded, whole)


def test_clip_grad_norm_without_data_parallelism():
    """tp=1 in one process: the module's clip equals torch's on the same model."""
    ref = models.build("gpt", layers=1)
    pm = autotp.parallelize(ref, tp=1, example_inputs=(models.tokens(2, 8, seed=1),))
    x, y = models.tokens(4, 8, seed=2), models.tokens(4, 8, seed=3)
    pm.step(x, target=y, loss_fn=models.loss_fn)
    models.loss_fn(ref(x), y).backward()
    for norm_type in (2.0, 1.0, math.inf):
        got = pm.clip_grad_norm_(0.1, norm_type)
        want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.1, norm_type)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=0)
    with pytest.raises(autotp.InputError, match="norm_type must be positive"):
        pm.clip_grad_norm_(1.0, -2)


def test_bad_data_parallel_settings():
    model, example = models.build("gpt", layers=1), (models.tokens(2, 8, 0),)
    with pytest.raises(autotp.InputError, match="dp must be a positive integer"):
        autotp.parallelize(model, tp=1, dp=0, example_inputs=example)
    with pytest.raises(autotp.InputError, match=r"dp_mode must be one of \['fsdp', 'replicate'\]"):
        autotp.parallelize(model, tp=1, dp=2, dp_mode="zero", example_inputs=example)
    with pytest.raises(autotp.InputError, match="do not pass group"):
        autotp.parallelize(model, tp=1, dp=2, group=object(), example_inputs=example)
    with pytest.raises(autotp.RuntimeSetupError, match=r"2 ranks \(tp x pp x dp\) need 2 processes"):
        autotp.parallelize(model, tp=1, dp=2, example_inputs=example)
    with pytest.raises(autotp.RuntimeSetupError, match=r"1 ranks but tp=2 x pp=2 x dp=2 needs 8.*tp x pp x dp"):
        check_world(None, False, 2, 2, 2)


def test_two_torchrun_nodes_on_localhost():
    """torchrun --nnodes 2 through the c10d rendezvous, as two machines would run it (about 20 s on 2 cores)."""
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    nodes = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node),
         "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"localhost:{port}",
         "--rdzv-id", f"autotp-test-{port}", "tests/multinode_script.py"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for node in (0, 1)]
    outputs = [p.communicate(timeout=300)[0] for p in nodes]
    for node, (p, out) in enumerate(zip(nodes, outputs)):
        assert p.returncode == 0, f"node {node} failed:\n{out[-3000:]}"
    # Two ranks of a node share its stdout, so their lines may interleave: find the reports anywhere.
    ok = sorted(re.findall(r"rank (\d) on node \d+: dp_rank (\d), exact after", "".join(outputs)))
    assert ok == [("0", "0"), ("1", "0"), ("2", "1"), ("3", "1")], "\n".join(outputs)


def test_plan_table_adds_the_replicas(capsys):
    """`autotp plan --dp`: what fsdp holds per rank is the dp=1 rank's parameters and moments over dp; replicate
    keeps them whole and all-reduces the gradients."""
    from autotp.tools import cli

    gpt = "examples/gpt.py:build_gpt"
    assert cli.main(["plan", gpt, "--tp", "2", "--pp", "2", "--dp", "2"]) == 0
    text = capsys.readouterr().out
    assert text.splitlines()[0].startswith("autotp plan for GPT: tp=2, pp=2, dp=2 (fsdp);"), text
    fullest = float(text.split("parameter memory per rank: ")[1].split(" KiB")[0]) * 1024
    line = next(x for x in text.splitlines() if "data parallelism" in x)
    sharded, whole = (float(v) * 1024 for v in re.search(r"per rank (\S+) KiB \(vs (\S+) KiB at dp=1\)", line).groups())
    assert sharded == pytest.approx(3 * fullest / 2, rel=0.01) and whole == pytest.approx(3 * fullest, rel=0.01), line
    assert cli.main(["plan", gpt, "--tp", "2", "--dp", "4", "--dp-mode", "replicate"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if "data parallelism" in x)
    assert "(dp=4, replicate)" in line and "1 all-reduce of the gradients" in line, line
