"""Per-rank bodies of the checkpoint-failure tests in ``tests/test_untrusted.py`` (importable by spawned ranks).

``faults`` runs on 2 gloo ranks and damages checkpoints in every way the tests name (another model's shapes,
flipped bytes, a truncated, deleted or unfinished shard, a missing tensor), recording each rank's error; it
also writes the checkpoint the kill test resumes from and the uninterrupted run to compare with. ``killed_save``
is a rank of a group whose rank 1 dies in the middle of a save; ``resume`` loads what is left and trains on.
"""

from __future__ import annotations

import os
import shutil
import signal
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

import autotp
from autotp.runtime.manifest import agree
from examples.gpt import build_gpt
from tests import models

ADAM = dict(lr=1e-3, eps=1e-6)
MISSING = "transformer.h.0.mlp.c_fc.bias"


def gpt(seed: int = 0, **sizes) -> torch.nn.Module:
    """The example GPT (tied embedding and head), seeded."""
    torch.manual_seed(seed)
    return build_gpt(**sizes)


def example() -> tuple[torch.Tensor]:
    """The example token ids every module of these tests is captured with."""
    return (models.tokens(2, 8, seed=1),)


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Four training batches: two before the checkpoint, two after it."""
    return [(models.tokens(4, 8, seed=10 + i), models.tokens(4, 8, seed=20 + i)) for i in range(4)]


def train(pm, opt, steps) -> None:
    """One AdamW step per batch (default cross-entropy)."""
    for x, y in steps:
        pm.step(x, target=y)
        opt.step()
        opt.zero_grad()


def _error(run) -> str:
    """``run()``'s autotp error as ``Type: message`` (``"no error"`` if it loaded)."""
    try:
        run()
    except autotp.AutotpError as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def _on_first(rank: int, action) -> None:
    """``action()`` on rank 0 while the other waits (files both ranks then read)."""
    if rank == 0:
        action()
    dist.barrier()


def _flip(path: Path) -> None:
    """Invert one byte in the middle of ``path``."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def _shard(folder: Path, rank: int) -> Path:
    return folder / f"__{rank}_0.distcp"


def _damaged_copies(folder: Path) -> None:
    """Copies of the ``resume`` checkpoint and the ``export`` damaged as the tests name them (rank 0 makes them)."""
    from safetensors.torch import load_file, save_file

    for name in ("flipped", "truncated", "deleted", "unfinished.autotp-partial", "in_place"):
        shutil.copytree(folder / "resume", folder / name)
    shutil.copytree(folder / "export", folder / "flipped_st")
    _flip(_shard(folder / "flipped", 1))
    _flip(folder / "flipped_st" / "model.safetensors")
    os.truncate(_shard(folder / "truncated", 0), 1000)  # into its first tensors
    _shard(folder / "deleted", 1).unlink()
    (folder / "in_place" / ".metadata").unlink()  # as a save writing in place and killed before its last file
    tensors = load_file(str(folder / "export" / "model.safetensors"))
    del tensors[MISSING]
    save_file(tensors, str(folder / "lacking.safetensors"))


def faults(rank: int, world: int, path: str) -> dict:
    """Every damaged or mismatched checkpoint of the tests, loaded at tp=2 on both ranks: each rank's error."""
    folder, out = Path(path), {}
    pm = autotp.parallelize(gpt(), tp=2, example_inputs=example(), quiet=True)
    opt = torch.optim.AdamW(pm.parameters(), **ADAM)
    steps = batches()
    train(pm, opt, steps[:2])
    pm.save(folder / "resume", optimizer=opt)  # the checkpoint the kill test must not lose
    pm.save(folder / "export", format="safetensors")
    before = pm.full_state_dict()
    train(pm, opt, steps[2:])
    uninterrupted = pm.full_state_dict()  # a collective: every rank gathers
    if rank == 0:
        torch.save(uninterrupted, folder / "uninterrupted.pt")

    # A bigger model's checkpoints (hidden 128, vocabulary 256), loaded into hidden 64 / vocabulary 128.
    big = autotp.parallelize(gpt(n_embd=128, vocab_size=256), tp=2, example_inputs=example(), quiet=True)
    big.save(folder / "big")
    big.save(folder / "big_st", format="safetensors")
    out["shape_dcp_load"] = _error(lambda: pm.load(folder / "big", quiet=True))
    out["shape_dcp_parallelize"] = _error(lambda: autotp.parallelize(gpt(), tp=2, example_inputs=example(),
                                                                     checkpoint=folder / "big", quiet=True))
    out["shape_st_load"] = _error(lambda: pm.load(folder / "big_st", quiet=True))
    out["shape_st_parallelize"] = _error(lambda: autotp.parallelize(
        gpt(), tp=2, example_inputs=example(), checkpoint=folder / "big_st" / "model.safetensors", quiet=True))

    # Damaged files: a flipped byte (DCP shard and safetensors export), a truncated shard, a deleted one.
    _on_first(rank, lambda: _damaged_copies(folder))
    out["flipped_dcp"] = _error(lambda: pm.load(folder / "flipped", quiet=True))
    out["flipped_st"] = _error(lambda: pm.load(folder / "flipped_st", quiet=True))
    out["truncated"] = _error(lambda: pm.load(folder / "truncated", quiet=True))
    out["truncated_unverified"] = _error(lambda: pm.load(folder / "truncated", quiet=True, verify=False))
    out["truncated_unverified_parallelize"] = _error(lambda: autotp.parallelize(
        gpt(), tp=2, example_inputs=example(), checkpoint=folder / "truncated", quiet=True, verify=False))
    out["deleted"] = _error(lambda: pm.load(folder / "deleted", quiet=True))
    out["deleted_unverified"] = _error(lambda: pm.load(folder / "deleted", quiet=True, verify=False))

    def rank_one_fails():
        if rank == 1:
            raise autotp.CheckpointError("rank 1 read a short file")
    out["one_rank_fails"] = _error(lambda: agree(rank_one_fails, None, True, "loading a checkpoint"))

    # Saves that did not finish: only the partial folder exists; DCP shards written in place without .metadata.
    out["unfinished"] = _error(lambda: pm.load(folder / "unfinished", quiet=True))
    out["unfinished_partial"] = _error(lambda: autotp.parallelize(gpt(), tp=2, example_inputs=example(), quiet=True,
                                                                  checkpoint=folder / "unfinished.autotp-partial"))
    out["in_place"] = _error(lambda: pm.load(folder / "in_place", quiet=True))

    # A real model given a checkpoint lacking a parameter: refused unless strict=False (it then keeps its own).
    lacking = folder / "lacking.safetensors"
    out["missing_parallelize"] = _error(lambda: autotp.parallelize(gpt(seed=5), tp=2, example_inputs=example(),
                                                                   checkpoint=lacking, quiet=True))
    out["missing_load"] = _error(lambda: pm.load(lacking, quiet=True))
    own = gpt(seed=5)
    loose = autotp.parallelize(own, tp=2, example_inputs=example(), checkpoint=lacking, quiet=True, strict=False)
    state = loose.full_state_dict()
    assert torch.equal(state[MISSING], own.state_dict()[MISSING]), "strict=False keeps the model's own value"
    assert all(torch.equal(state[k], v) for k, v in before.items() if k != MISSING), "the rest comes from the file"
    pm.load(lacking, quiet=True, strict=False)
    out["strict_false"] = "loaded"
    return out


def killed_save(rank: int, world: int, port: int, path: str) -> None:
    """A rank of a 2-rank group that trains differently and saves over the ``resume`` checkpoint; rank 1 dies
    (SIGKILL) after writing half of its shard, before the save can finish."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    folder = Path(path)
    pm = autotp.parallelize(gpt(seed=7), tp=2, example_inputs=example(), quiet=True)
    opt = torch.optim.AdamW(pm.parameters(), **ADAM)
    train(pm, opt, batches()[:1])
    if rank == 1:
        from torch.distributed.checkpoint import FileSystemWriter

        write_data = FileSystemWriter.write_data

        def die_while_writing(self, plan, planner):
            written = write_data(self, plan, planner)
            for shard in Path(self.path).glob(f"__{rank}_*.distcp"):
                os.truncate(shard, shard.stat().st_size // 2)  # as if killed while the file was being written
            os.kill(os.getpid(), signal.SIGKILL)
            return written

        FileSystemWriter.write_data = die_while_writing
    pm.save(folder / "resume", optimizer=opt)


def resume(rank: int, world: int, path: str) -> dict:
    """Load the ``resume`` checkpoint the killed save left, train on, and compare with the uninterrupted run."""
    folder = Path(path)
    steps = batches()
    pm = autotp.parallelize(gpt(seed=3), tp=2, example_inputs=example(), checkpoint=folder / "resume", quiet=True)
    opt = torch.optim.AdamW(pm.parameters(), **ADAM)
    pm.load(folder / "resume", optimizer=opt, quiet=True)
    train(pm, opt, steps[2:])
    want = torch.load(folder / "uninterrupted.pt", weights_only=True)
    got = pm.full_state_dict()
    differ = [k for k, v in want.items() if not torch.equal(got[k], v)]
    return {"differ": differ, "keys": len(want)}
