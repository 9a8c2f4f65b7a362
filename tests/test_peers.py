"""Peers and inputs: one batch per tensor-parallel group, and every failure bounded and named (gloo ranks)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from autotp.errors import InputError
from autotp.runtime.batch_agreement import inputs_started
from autotp.runtime.peers import EXIT_HUNG
from tests import peers_workers
from tests.distributed import on_threads, run_on_ranks

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT = 20.0
"""parallelize(timeout=) in the failure scenarios: short, so the tests are, yet long enough that ranks capturing
at different speeds on a loaded 2-core machine (ten processes start at once) still meet within it."""


def test_one_batch_per_tensor_parallel_group_and_ids_in_the_vocabulary():
    """Different batches, batch sizes or targets on the two tp ranks (and on two pp ranks), out-of-range ids with
    the vocabulary split and an empty batch: each an InputError on every rank, after which the group still
    computes exactly."""
    for rank in run_on_ranks(peers_workers.inputs_on_ranks, 2):
        assert rank["exact"] < 1e-5 and rank["after"] < 1e-5
        assert rank["values"].startswith("InputError: idx holds different values on ranks [1] of one model replica")
        assert "by data-parallel rank (pm.dp_rank)" in rank["values"]
        assert rank["batch"].startswith("InputError: idx has different shapes on the ranks of one model replica "
                                        "(rank 0: (2, 16), rank 1: (4, 16))")
        assert rank["pp_batch"] == rank["batch"], rank["pp_batch"]
        assert rank["pp_target"].startswith("InputError: target holds different values on ranks [1]")
        assert rank["pp_after"] < 1e-5
        assert rank["target"].startswith("InputError: target holds different values")
        assert rank["high"].startswith(f"InputError: idx holds token id {128}, outside the vocabulary of 128")
        assert rank["negative"].startswith("InputError: idx holds token id -")
        assert "must lie in [0, 128)" in rank["negative"]
        assert rank["empty"].startswith("InputError: input idx is empty (shape (0, 16))")


def test_the_batch_check_begun_completes_before_the_next_collective_or_when_asked():
    """The check begun before a forward completes as the communicator's next collective begins (the work between
    overlaps it), raising there on every rank when the batches differ; or when its completion is called, once."""
    def differing(comm):
        ids = torch.arange(8).reshape(2, 4) + comm.rank
        inputs_started(("idx",), (ids,), comm)
        ran = torch.ones(3) * 2  # this rank's compute, before the first collective
        with pytest.raises(InputError, match=r"idx holds different values on ranks \[1\]"):
            comm.all_reduce(ran)
        return comm.pending is None
    assert on_threads(2, differing) == [True, True]

    def resized(comm):
        complete = inputs_started(("idx", "target"), (torch.zeros(2 + comm.rank, 4), None), comm)
        with pytest.raises(InputError, match=r"idx has different shapes .*\(rank 0: \(2, 4\), rank 1: \(3, 4\)\)"):
            complete()
        complete()  # once: the all-gather is not waited for again
        return comm.all_reduce(torch.ones(1)).item()
    assert on_threads(2, resized) == [2.0, 2.0]

    def agreeing(comm):
        complete = inputs_started(("idx",), (torch.arange(6),), comm)
        total = comm.all_reduce(torch.ones(1)).item()
        complete()
        return total, comm.pending
    assert on_threads(2, agreeing) == [(2.0, None), (2.0, None)]


def test_a_hung_killed_or_failing_rank_stops_its_peers_within_the_timeout_naming_it():
    """pp=2 and tp=2: the last rank sleeps, is killed, or raises on its own; the other exits within the timeout
    (the group's own is 300 s: parallelize's timeout= bounds it, pipeline groups included) with RankFailure
    naming rank 1."""
    scenarios = [({"tp": 1, "pp": 2}, "hang", 2), ({"tp": 2}, "hang", 2),
                 ({"tp": 1, "pp": 2}, "kill", 2), ({"tp": 2}, "kill", 2), ({"tp": 2}, "raise", 2)]
    results = peers_workers.spawn_worlds(scenarios, TIMEOUT)
    for (layout, mode, _), ranks in zip(scenarios, results):
        label = f"{layout} {mode}"
        healthy, failed = ranks
        assert healthy is not None, label
        assert healthy["error"].startswith("RankFailure: rank 0: step #2 could not finish: rank 1"), (label, healthy)
        assert healthy["seconds"] < 4 * TIMEOUT, (label, healthy)  # generous: bounded, not timed
        if mode == "raise":
            assert "rank 1 failed: InputError: idx holds token id" in healthy["error"], label
            assert failed["error"].startswith("InputError: idx holds token id"), label
        else:
            assert "rank 1 (it began 1 of these calls) stopped or hangs before call #2" in healthy["error"], label
            assert failed is None, label


def test_under_torchrun_the_hung_rank_is_the_root_cause():
    """Rank 1 hangs; rank 0 names it, rank 1's watchdog records its failure and exits first, so torchrun's
    "Root Cause (first observed failure)" is rank 1, not the healthy rank that noticed."""
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                          "--monitor-interval", "0.1", str(ROOT / "tests" / "peers_torchrun.py")],
                         capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert run.returncode != 0
    report = run.stderr + run.stdout
    root = report[report.index("Root Cause (first observed failure)"):]
    assert "rank      : 1 (local_rank: 1)" in root.splitlines()[4], root
    assert "rank 1 did not answer its peers within the timeout" in root, root
    assert f"exitcode  : {EXIT_HUNG}" in root, root
