"""Checkpoints on 2 real gloo ranks: meta models loaded from safetensors/HF/DCP, DCP save and resharded load
(optimizer included), the Hugging Face export; plus the pure parts (a rank's Part, the progress bar)."""

from __future__ import annotations

import io

import pytest
import torch
from autotp.passes.placement import Placement, local_shard, part_of

from autotp.runtime import dcp
from autotp.runtime.progress import Progress
from tests import capture_cache, checkpoint_workers, models
from tests.checkpoint_workers import dp_checkpoints
from tests.distributed import run_on_ranks


@pytest.fixture(scope="module")
def workflow(tmp_path_factory):
    return run_on_ranks(checkpoint_workers.workflow, 2, str(tmp_path_factory.mktemp("ckpt")))


def test_meta_buffer_missing_from_the_checkpoint_is_named(workflow):
    message = workflow[0]["meta_buffer_error"]
    assert "model.rotary_emb.inv_freq" in message and "buffer" in message, message
    assert "init_empty_weights" in message, message


def test_workflow_checked_on_every_rank(workflow):
    # The worker asserts equality at each step; here: what it touched is what the test meant.
    assert any(name.endswith(".index.json") for name in workflow[0]["hf_files"]), workflow[0]["hf_files"]
    export = workflow[0]["export_files"]
    assert "config.json" in export and "model.safetensors.index.json" in export and len(export) > 3, export
    keys = workflow[0]["dcp_keys"]
    assert "model.model.layers.0.self_attn.q_proj.weight" in keys
    assert "optimizer.state.model.layers.0.self_attn.q_proj.weight.exp_avg" in keys
    assert "model.lm_head.weight" not in keys, "a tied weight is saved once, under its first name"
    # A vocabulary tp does not divide is saved with its full rows (the worker loads it back at tp=2 and tp=1).
    odd = workflow[0]["odd_vocabulary"]
    assert odd["embed.weight"] == [81, 32] and odd["head.weight"] == [81, 32], odd
    # Each pipeline rank holds its stages only.
    assert all(0 < r["pipeline_local_params"] for r in workflow)


@pytest.mark.parametrize("segments", [(), (4, 4, 8)])
def test_part_takes_what_local_shard_takes(segments):
    full = torch.arange(16 * 3).reshape(16, 3)
    placement = Placement("colwise", 0, segments)
    for rank in range(2):
        part = part_of(placement, (16, 3), rank, 2)
        assert torch.equal(part.take(full), local_shard(full, 0, segments or (16,), rank, 2))
        assert part.local_shape == (8, 3)
        # Each chunk sits at its global offsets.
        for (offsets, sizes), view in zip(part.chunks(), part.views(part.take(full))):
            assert torch.equal(view, full[offsets[0]:offsets[0] + sizes[0]])


def test_progress_draws_only_when_shown():
    shown, hidden = io.StringIO(), io.StringIO()
    for stream, show in ((shown, True), (hidden, False)):
        bar = Progress("loading x", 2, 2 * 2**20, show, stream)
        bar.advance(2**20)
        bar.advance(2**20)
        bar.close()
    assert "2/2 tensors, 2/2 MB" in shown.getvalue() and "100%" in shown.getvalue()
    assert hidden.getvalue() == ""


def test_dcp_chunks_of_a_fused_split_reshard(tmp_path):
    """A fused weight split per segment is several chunks per rank; any other layout reads its own runs back."""
    full = torch.randn(12, 5)
    placement = Placement("colwise", 0, (4, 4, 4))
    parts = [part_of(placement, (12, 5), rank, 2) for rank in range(2)]
    # One process writes both ranks' chunks (as two ranks would, each its own).
    chunks = [c for p in parts for c in dcp.Sharded.of(p.take(full), p).chunks]
    dcp.save({"model.w": dcp.Sharded((12, 5), chunks)}, tmp_path, None, False)
    saved = dcp.tensor_metadata(dcp.read_metadata(tmp_path))["model.w"]
    assert sorted(c.offsets[0] for c in saved.chunks) == [0, 2, 4, 6, 8, 10] and tuple(saved.size) == (12, 5)
    for tp in (1, 4):
        for rank in range(tp):
            part = part_of(placement, (12, 5), rank, tp)
            local = torch.empty(part.local_shape)
            dcp.load({"model.w": dcp.Sharded.of(local, part)}, tmp_path)
            assert torch.equal(local, part.take(full)), (tp, rank)


def test_checkpoints_with_data_parallel_replicas(tmp_path):
    """Saved by fsdp replicas (dp=2 x tp=2) with AdamW state; loaded by replicate replicas, by fsdp replicas and
    at tp=4: each equals one process after the same steps, and goes on training like it; the safetensors export
    at dp=2 loads back with from_pretrained."""
    capture_cache.warm(checkpoint_workers.llama(layers=1), models.tokens(8, 12, 5)[:2])  # once, not once per rank
    results = run_on_ranks(dp_checkpoints, 4, str(tmp_path))
    for rank, errors in enumerate(results):
        assert list(errors) == ["fsdp dp=2 trained", "replicate loaded", "replicate after a resumed step", "fsdp loaded",
                                "fsdp after a resumed step", "tp=4 loaded", "tp=4 after a resumed step",
                                "exported at dp=2, loaded by from_pretrained"]
        for what, error in errors.items():
            assert error < 1e-5, f"rank {rank}, {what}: state off by {error:.2e} from one process's"
