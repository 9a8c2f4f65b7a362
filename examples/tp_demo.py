"""Tensor-parallel demo: plan the example GPT, shard it over the launched ranks, compare with the original.

    torchrun --nproc-per-node 2 examples/tp_demo.py

Every rank builds the same unsharded model (same seed), so each can check its sharded result against it.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import autotp  # noqa: E402
from examples.gpt import build_gpt  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3, help="training steps to compare")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")  # torchrun's environment names the rank and world size
    rank, tp = dist.get_rank(), dist.get_world_size()

    torch.manual_seed(0)
    model = build_gpt(n_layer=2)
    ids = torch.randint(0, model.config.vocab_size, (4, 32))
    pm = autotp.parallelize(model, tp=tp, example_inputs=(ids,))
    if rank == 0:
        print(pm.plan.summary())
        local, total = sum(getattr(p, "to_local", lambda: p)().numel() for p in pm.parameters()), sum(p.numel() for p in model.parameters())
        print(f"parameters on rank 0: {local} of {total} ({local / total:.0%})")

    x = torch.randint(0, model.config.vocab_size, (3, 20))  # another shape than the example
    max_diff = (pm(x) - model(x)).abs().max().item()
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-3, eps=1e-6)
    ref_opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6)
    for step in range(args.steps):
        target = torch.randint(0, model.config.vocab_size, x.shape)
        loss = pm.step(x, target=target)
        ref_loss = autotp.runtime.default_loss(model(x), target)
        ref_loss.backward()
        opt.step(), ref_opt.step(), opt.zero_grad(), ref_opt.zero_grad()
        if rank == 0:
            print(f"step {step}: loss {loss.item():.6f} (unsharded {ref_loss.item():.6f})")
    full = pm.full_state_dict()
    param_diff = max((full[k] - v).abs().max().item() for k, v in model.state_dict().items())
    if rank == 0:
        print(f"max |output difference| vs unsharded model: {max_diff:.2e}")
        print(f"max |parameter difference| after {args.steps} AdamW steps: {param_diff:.2e}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
