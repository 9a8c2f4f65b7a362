"""The loop people write trains the parallel module exactly like the unsharded model: micro-batch accumulation with
``(out.loss / k).backward()``, torch's own ``clip_grad_norm_`` on ``pm.parameters()`` (DTensors that state their
tensor-parallel layout), an optimizer and an LR scheduler; drifted replicated parameters are named; ``pm.step``'s
loss scale; a scheduler saved and loaded with the module."""

from __future__ import annotations

import math

import pytest

from autotp.errors import InputError
from autotp.runtime.parallel_base import checked_scale
from tests import capture_cache, loop_workers, models
from tests.distributed import run_on_ranks


@pytest.fixture(scope="module")
def warmed():
    """The loops' Llamas captured here once, before any rank is forked: every rank of every test below finds them
    captured (each would otherwise capture its model again, train and eval)."""
    for kv_heads in (2, 1):
        capture_cache.warm(loop_workers._llama(kv_heads), loop_workers._batch(0, 0))
    capture_cache.warm(models.build("hf_llama", layers=1), loop_workers._batch(0, 0))


@pytest.mark.parametrize("tp, dp, mode, kv_heads", [(2, 1, "replicate", 2), (2, 2, "fsdp", 2),
                                                    (4, 1, "replicate", 2), (2, 2, "replicate", 1)])
def test_the_plain_loop_with_torch_clipping_trains_like_one_process(tp, dp, mode, kv_heads, warmed):
    """The worker compared torch's clipped norm every step and every parameter after; here: each rank finished.
    At tp=4 the Llama's 2 KV heads (at tp=2 x dp=2 its 1 KV head) are chunks two ranks hold each: DTensors on the
    (tp / 2, 2) view of each replica's tp ranks, so torch's clipping counts each once (no plain parameters, no
    warning). tp=2 x dp=2 under replicate with 2 KV heads (a 1-D tp mesh per replica) is Trainer's and
    accelerate's case in test_trainer.py."""
    assert run_on_ranks(loop_workers.loop_trains_like_one_process, tp * dp, tp, dp, mode, kv_heads) == [
        f"tp={tp} dp={dp} {mode}"] * (tp * dp)


def test_shared_chunks_in_a_tensor_parallel_group_of_part_of_the_world(warmed):
    """``group=`` a pair of 4 ranks, a 1-KV-head Llama at tp=2: DTensors on the pair's own 2-D view, torch's
    clipping exact (no warning)."""
    assert run_on_ranks(loop_workers.shared_chunks_in_a_group, 4) == ["pair 0"] * 2 + ["pair 1"] * 2


def test_replicated_parameters_that_drift_apart_are_named(warmed):
    """An optimizer stepped on one rank only: the next forward names a replicated parameter and the likely causes,
    on both ranks alike."""
    (message, replicated), (other, _) = run_on_ranks(loop_workers.drift_is_named, 2)
    assert message == other
    assert message.split(",")[0] in replicated, message
    for cause in ("holds whole, holds different values on ranks [1]", "clip_grad_norm_", "optimizer stepped"):
        assert cause in message, message


def test_step_with_a_loss_scale_accumulates_like_one_process(warmed):
    run_on_ranks(loop_workers.step_accumulates_like_one_process, 2)


def test_the_scheduler_is_saved_and_loaded_with_the_module(tmp_path, warmed):
    run_on_ranks(loop_workers.scheduler_survives_save_and_load, 2, str(tmp_path / "ckpt"))


@pytest.mark.parametrize("bad", [0, -0.5, math.inf, math.nan, "1/4", True, None])
def test_a_loss_scale_that_is_no_positive_number_is_refused(bad):
    with pytest.raises(InputError, match="loss_scale must be a positive finite number"):
        checked_scale(bad)


def test_foreach_and_fused_optimizers_and_clipping_over_dtensor_parameters(warmed):
    assert run_on_ranks(loop_workers.fast_optimizers_train_like_one_process, 2) == [["foreach", "fused"]] * 2
