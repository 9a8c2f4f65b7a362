"""Bytes per rank: parameters, AdamW state and activations, against the whole model's divided by tp·pp.

Activations are the tensors autograd saves for backward during one forward (counted once per storage,
parameters excluded): what a step holds between forward and backward. On a GPU the peak allocated
memory of the step is recorded as well.
"""

from __future__ import annotations

import gc

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from bench import comm
from bench.config import BenchConfig
from bench.variants import TP_VARIANTS, TPGroup, batch, build_model, build_variant, loss_fn, zero_grad


def _local(t: torch.Tensor) -> torch.Tensor:
    """The tensor this rank stores (a DTensor's local shard)."""
    return t.to_local() if isinstance(t, DTensor) else t


def tensor_bytes(tensors) -> int:
    """Bytes of distinct tensors (tied or repeated ones counted once), local shards only."""
    seen = {}
    for t in tensors:
        local = _local(t)
        seen[id(t)] = local.numel() * local.element_size()
    return sum(seen.values())


def optimizer_bytes(opt: torch.optim.Optimizer) -> int:
    """Bytes of the optimizer's state tensors (AdamW: two moments per parameter)."""
    return tensor_bytes(v for state in opt.state.values() for v in state.values() if isinstance(v, torch.Tensor))


def _storage(t: torch.Tensor):
    local = _local(t)
    return local.untyped_storage().data_ptr(), local.untyped_storage().nbytes()


class SavedActivations(torch.autograd.graph.saved_tensors_hooks):
    """Sums the storages autograd saves for backward inside the block, parameters excluded."""

    def __init__(self, params):
        self.exclude = {_storage(p)[0] for p in params}
        self.storages: dict[int, int] = {}

        def pack(t):
            ptr, nbytes = _storage(t)
            if ptr not in self.exclude:
                self.storages[ptr] = nbytes
            return t

        super().__init__(pack, lambda t: t)

    @property
    def bytes(self) -> int:
        """Bytes saved so far."""
        return sum(self.storages.values())


def measure_step(module: nn.Module, x, y, cfg: BenchConfig, count: bool) -> dict:
    """One training step of ``module``: parameter, AdamW-state and activation bytes (and collectives)."""
    params = list(module.parameters())
    zero_grad(module)
    cuda = cfg.device == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    saved = SavedActivations(params)

    def forward():
        with saved:
            return module(x)

    if count:
        collectives = comm.count_step(forward, lambda out: loss_fn(out, y))
    else:
        collectives = None
        loss_fn(forward(), y).backward()
    out = {"param_bytes": tensor_bytes(params), "activation_bytes": saved.bytes}
    if cuda:
        out["peak_step_bytes"] = torch.cuda.max_memory_allocated() - before
    opt = torch.optim.AdamW(params, lr=1e-4)
    opt.step()
    out["optimizer_bytes"] = optimizer_bytes(opt)
    if collectives is not None:
        out["comm"] = collectives
    return out


def memory_section(rank: int, tpg: TPGroup, cfg: BenchConfig) -> dict:
    """Per-rank bytes of every variant on ``cfg.memory``'s model, and of the single model for reference.

    Variants are built and measured one at a time, so one rank never holds two of them.
    """
    shape = cfg.memory
    model = build_model(shape, cfg)
    x, y = batch(shape, cfg)
    results = {}
    for name in TP_VARIANTS:
        variant = build_variant(name, model, x, tpg)
        results[name] = measure_step(variant.module, x, y, cfg, count=True)
        del variant
        gc.collect()
    # Last: its AdamW step changes the model the variants above were built from.
    results["single"] = measure_step(model, x, y, cfg, count=False)
    return {"shape": shape.describe(), "tp": len(tpg.ranks), "pp": cfg.pp, "rank": rank, "per_variant": results,
            "comm_minimum": comm.megatron_minimum(shape, torch.finfo(cfg.torch_dtype).bits // 8, vocab_parallel_loss=False)}
