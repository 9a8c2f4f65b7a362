"""Train the example GPT with tensor, pipeline and data parallelism on a small text that ships with the repo.

    torchrun --nproc-per-node 4 examples/train_gpt.py --tp 2 --pp 2
    torchrun --nproc-per-node 8 examples/train_gpt.py --tp 2 --pp 2 --dp 2

Prints the plan, the loss as it falls, tokens per second, and each rank's parameters and peak memory. The
model is a character-level nanoGPT-style GPT; every rank samples the same global batches (same seed) and
each data-parallel replica trains on its slice of them (``pm.dp_rank`` of ``pm.dp_size``).
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import autotp  # noqa: E402
from examples.gpt import build_gpt  # noqa: E402

TEXT = Path(__file__).resolve().parent / "data" / "alice.txt"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Train the example GPT with autotp (tp x pp x dp ranks).")
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel ranks")
    p.add_argument("--pp", type=int, default=2, help="pipeline stages (ranks)")
    p.add_argument("--dp", type=int, default=1, help="data-parallel replicas (each trains on batch/dp rows)")
    p.add_argument("--dp-mode", default="fsdp", choices=["fsdp", "replicate"])
    p.add_argument("--clip", type=float, default=1.0, help="clip the gradients' global norm to this")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--batch", type=int, default=16, help="global batch (all replicas together)")
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--microbatches", type=int, default=None, help="default: one per stage")
    p.add_argument("--schedule", default="1f1b", choices=["gpipe", "1f1b", "interleaved1f1b"])
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--vocab", default="auto", choices=["auto", "split", "whole"],
                   help="split the embedding and head along the vocabulary (auto: as the cost model finds faster)")
    p.add_argument("--compile", action="store_true", help="run the rank graphs under torch.compile (pp=1, dp=1)")
    return p.parse_args()


def encode(text: str, tp: int) -> tuple[torch.Tensor, int]:
    """Character ids, and a vocabulary size padded to a multiple of 8·tp so the vocabulary splits evenly."""
    chars = sorted(set(text))
    ids = torch.tensor([chars.index(c) for c in text], dtype=torch.long)
    multiple = 8 * tp
    return ids, (len(chars) + multiple - 1) // multiple * multiple


def build_model(tp: int = 2, seq: int = 64):
    """The GPT this script trains (at its default --tp and --seq): ``autotp plan examples/train_gpt.py:build_model``
    plans the same model."""
    _, vocab = encode(TEXT.read_text(), tp)
    return build_gpt(n_layer=4, n_head=4, n_embd=128, vocab_size=vocab, block_size=seq)


def batches(data: torch.Tensor, batch: int, seq: int, seed: int):
    """Random windows of the text and the same windows shifted by one (the next characters)."""
    gen = torch.Generator().manual_seed(seed)
    while True:
        starts = torch.randint(0, len(data) - seq - 1, (batch,), generator=gen)
        x = torch.stack([data[s:s + seq] for s in starts])
        y = torch.stack([data[s + 1:s + seq + 1] for s in starts])
        yield x, y


def peak_memory_mb() -> float:
    """This process's peak resident memory (GPU: peak allocated)."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def mean_over_ranks(loss: torch.Tensor) -> torch.Tensor:
    """The global batch's loss: the mean of the replicas' (every rank of one replica holds its replica's)."""
    loss = loss.clone()
    dist.all_reduce(loss)
    return loss / dist.get_world_size()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank = dist.get_rank()
    data, _ = encode(TEXT.read_text(), args.tp)
    torch.manual_seed(0)
    model = build_model(args.tp, args.seq)
    stream = batches(data, args.batch, args.seq, seed=1)
    x, y = next(stream)
    pm = autotp.parallelize(model, tp=args.tp, pp=args.pp, dp=args.dp, dp_mode=args.dp_mode, example_inputs=(x,),
                            microbatches=args.microbatches, schedule=args.schedule, vocab=args.vocab,
                            compile=args.compile)
    rows = slice(pm.dp_rank * args.batch // pm.dp_size, (pm.dp_rank + 1) * args.batch // pm.dp_size)
    if rank == 0:
        print(pm.plan.summary(), flush=True)
    opt = torch.optim.AdamW(pm.parameters(), lr=args.lr)
    start, first_loss = time.perf_counter(), None
    for step in range(args.steps):
        loss = mean_over_ranks(pm.step(x[rows], target=y[rows]))  # each replica's loss on its slice
        pm.clip_grad_norm_(args.clip)
        opt.step()
        opt.zero_grad()
        first_loss = first_loss if first_loss is not None else loss.item()
        if rank == 0 and (step % 10 == 0 or step == args.steps - 1):
            rate = (step + 1) * args.batch * args.seq / (time.perf_counter() - start)
            print(f"step {step:3d}  loss {loss.item():.4f}  {rate:,.0f} tokens/s", flush=True)
        x, y = next(stream)
    params = sum(getattr(p, "to_local", lambda: p)().numel() for p in pm.parameters())  # FSDP: this rank's shard
    report = [None] * dist.get_world_size()
    dist.all_gather_object(report, (params, peak_memory_mb()))
    if rank == 0:
        total = sum(p.numel() for p in model.parameters())
        print(f"loss {first_loss:.4f} -> {loss.item():.4f} over {args.steps} steps")
        for r, (n, mb) in enumerate(report):
            print(f"rank {r}: {n:,} parameters ({n / total:.0%} of {total:,}), peak memory {mb:.0f} MiB")
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
