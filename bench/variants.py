"""The implementations compared, each built on every rank from the same seeded examples.gpt.GPT.

``autotp``: ``autotp.parallelize`` on the unmodified model. ``megatron``: the hand-written reference
(bench/megatron.py). ``torch_tp``: ``parallelize_module`` with a hand-written plan (bench/torch_tp.py).
``single``: the unsharded model itself, run by one process.

On CPU each single-process baseline gets a rank of its own, started with its thread count, which it
keeps: changing torch's thread count inside a process stalls OpenMP for up to seconds afterwards
(measured here), which would pollute whatever runs next. Ranks not running a variant wait in a
barrier, which does not spin (measured: 0.5 ms of CPU while another rank ran for 20 ms).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.nn import functional as F

import autotp
from bench.config import BenchConfig, ModelShape
from bench.megatron import MegatronGPT
from bench.torch_tp import torch_tp_model
from examples.gpt import build_gpt

TP_VARIANTS = ("autotp", "megatron", "torch_tp")
# Largest |logits - single's logits|, relative to max(1, |single's logits|), a variant may show.
TOLERANCE = {"fp32": 1e-4, "bf16": 5e-2}


@dataclass
class Variant:
    """One implementation, ready to step."""

    name: str
    module: nn.Module | None
    """None on ranks that do not run it."""
    ranks: frozenset[int]
    """The ranks that run it; the others wait."""
    step_fn: Callable | None = None
    """How one timed step runs, ``step_fn(module, x, y)``; None: ``step`` (forward, loss, backward)."""


@dataclass(frozen=True)
class Roles:
    """Which rank does what: ranks 0..tp-1 run the tensor-parallel variants, ``singles`` the baselines."""

    tp: int
    singles: dict[str, int]
    """Baseline name -> the rank that runs it."""
    threads: tuple[int, ...]
    """torch threads of every rank."""

    @property
    def world(self) -> int:
        """Processes to spawn."""
        return len(self.threads)


def roles(cfg: BenchConfig) -> Roles:
    """CPU: tp ranks of ``threads_per_rank`` threads plus one rank per baseline thread count.
    GPU: tp ranks, the baseline on rank 0's GPU."""
    if cfg.device == "cuda":
        return Roles(cfg.tp, {"single": 0}, (0,) * cfg.tp)
    singles = {f"single_{n}t": cfg.tp + i for i, n in enumerate(cfg.single_threads)}
    return Roles(cfg.tp, singles, (cfg.threads_per_rank,) * cfg.tp + tuple(cfg.single_threads))


def build_model(shape: ModelShape, cfg: BenchConfig) -> nn.Module:
    """The seeded GPT of ``shape`` on ``cfg``'s device and dtype (every rank builds the same one)."""
    torch.manual_seed(cfg.seed)
    model = build_gpt(**shape.gpt_kwargs())
    return model.to(device=device_of(cfg), dtype=cfg.torch_dtype)


def device_of(cfg: BenchConfig) -> torch.device:
    """This rank's device: its GPU (set by the spawner) or the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if cfg.device == "cuda" else torch.device("cpu")


def batch(shape: ModelShape, cfg: BenchConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and next-token targets of ``shape``'s batch, the same on every rank."""
    g = torch.Generator().manual_seed(cfg.seed + 1)
    ids = torch.randint(0, shape.vocab_size, (shape.batch, shape.seq + 1), generator=g)
    ids = ids.to(device_of(cfg))
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of full logits (in fp32, as mixed-precision training computes it)."""
    return F.cross_entropy(logits.float().flatten(0, 1), target.flatten())


def _autotp(model, x, group, mesh):
    # The vocabulary split, as the Megatron baseline: like for like (bench.vocab_choice times the choice).
    return autotp.parallelize(model, tp=dist.get_world_size(group), example_inputs=(x,), group=group, vocab="split")


def _megatron(model, x, group, mesh):
    return MegatronGPT(model, group)


def _torch_tp(model, x, group, mesh):
    return torch_tp_model(model, mesh)


BUILDERS: dict[str, Callable] = {"autotp": _autotp, "megatron": _megatron, "torch_tp": _torch_tp}


@dataclass(frozen=True)
class TPGroup:
    """The tensor-parallel ranks as a process group and as the DeviceMesh parallelize_module needs.

    Every rank must create both (creating a group is collective), members or not.
    """

    group: object
    mesh: DeviceMesh
    ranks: frozenset[int]


def tp_group(cfg: BenchConfig) -> TPGroup:
    """Ranks 0..tp-1 (a collective call: every rank makes it)."""
    ranks = list(range(cfg.tp))
    return TPGroup(dist.new_group(ranks), DeviceMesh(cfg.device, ranks), frozenset(ranks))


def build_variant(name: str, model: nn.Module, x: torch.Tensor, tpg: TPGroup) -> Variant:
    """Tensor-parallel variant ``name`` of ``model`` over the tp ranks."""
    if name not in BUILDERS:
        raise ValueError(f"unknown variant {name!r}; choose from {', '.join(BUILDERS)}")
    module = BUILDERS[name](model, x, tpg.group, tpg.mesh)
    own = (lambda m, x, y, name=name: train_step(m, x, y, name)) if name in TRAINING_LOSSES else None
    return Variant(name, module, tpg.ranks, own)


def single_variants(model: nn.Module, r: Roles) -> dict[str, Variant]:
    """The unsharded model, once per baseline rank."""
    return {name: Variant(name, model, frozenset({rank})) for name, rank in r.singles.items()}


def max_diff(module: nn.Module, model: nn.Module, x: torch.Tensor) -> float:
    """Largest |module(x) - model(x)|, relative to max(1, |model(x)|)."""
    with torch.no_grad():
        want, got = model(x).float(), module(x).float()
    return float((got - want).abs().max()) / max(1.0, float(want.abs().max()))


def zero_grad(module: nn.Module) -> None:
    """Drop the gradients, so every step allocates them as a training step does."""
    for p in module.parameters():
        p.grad = None


def step(module: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
    """One forward and backward (the timed unit)."""
    zero_grad(module)
    loss_fn(module(x), y).backward()


TRAINING_LOSSES: dict[str, Callable] = {
    "autotp": lambda pm, x, y: pm.loss(x, target=y),  # pm.step's loss: vocab-parallel, logits never gathered
    "megatron": lambda m, x, y: m(x, y),  # Megatron's vocab_parallel_cross_entropy
}
"""How a variant computes the loss it trains on, where that is not the cross-entropy of its (whole) logits."""


def training_loss(v: Variant, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The loss one training step of ``v`` backpropagates."""
    own = TRAINING_LOSSES.get(v.name)
    return own(v.module, x, y) if own is not None else loss_fn(v.module(x), y)


def train_step(module: nn.Module, x: torch.Tensor, y: torch.Tensor, name: str) -> None:
    """One forward and backward of variant ``name`` on its own training loss."""
    zero_grad(module)
    training_loss(Variant(name, module, frozenset()), x, y).backward()


def run_step(v: Variant, x: torch.Tensor, y: torch.Tensor):
    """One timed step of ``v`` on this rank (its ``step_fn``, or ``step``); returns what that returns."""
    return (v.step_fn or step)(v.module, x, y)
