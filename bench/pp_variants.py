"""The pipelined implementations compared, each a ``Variant`` whose step is one whole training step.

``autotp``: ``autotp.parallelize(..., pp=...)`` on the unmodified model (its ``step`` runs the schedule
over every microbatch). ``megatron_pp``: the hand-written Megatron reference (bench/megatron.py) split in
two by hand, each half a ``torch.distributed.pipelining.PipelineStage`` on a (pp x tp) DeviceMesh,
driven by the same schedule class. ``single_mb<m>``: the unsharded model on one rank, stepping the
batch as m microbatches with gradient accumulation (what microbatching alone costs, with no pipeline).
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

import autotp
from bench.config import BenchConfig
from bench.megatron import MegatronGPT, MegatronStage
from bench.variants import TOLERANCE, Variant, device_of, loss_fn, run_step, zero_grad

SCHEDULE_CLASSES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


def even_split(n_layers: int, stages: int) -> list[int]:
    """Blocks per stage when split evenly by count (the first stages take the remainder)."""
    if stages < 1 or n_layers < stages:
        raise ValueError(f"cannot split {n_layers} layers into {stages} stages")
    base, extra = divmod(n_layers, stages)
    return [base + (i < extra) for i in range(stages)]


def even_cuts(n_layers: int, stages: int) -> list[str]:
    """The blocks that start stages 1.. of an even split: autotp's ``cuts`` for it (``transformer.h.6``)."""
    counts = even_split(n_layers, stages)
    return [f"transformer.h.{sum(counts[:i])}" for i in range(1, stages)]


def pp_mesh(cfg: BenchConfig, pp: int) -> DeviceMesh:
    """A (pp x tp) mesh over the default group, laid out as autotp lays out its own (collective)."""
    return init_device_mesh(cfg.device, (pp, cfg.tp), mesh_dim_names=("pp", "tp"))


class HandPipeline(nn.Module):
    """This rank's half of the hand-written pipeline: embedding + first blocks, or last blocks + head.

    The schedule is built once and stepped every iteration, as a training loop does (with
    ``rebuild``, a new one every step: a diagnostic, see docs/BENCHMARKS.md).
    """

    def __init__(self, gpt: nn.Module, mesh: DeviceMesh, microbatches: int, schedule: str, device,
                 rebuild: bool = False):
        super().__init__()
        pp, pp_rank = mesh.size(0), mesh.get_local_rank("pp")
        if pp != 2:
            raise ValueError(f"the hand-written split has two halves (the tied table on both), got pp={pp}")
        counts = even_split(len(gpt.transformer.h), pp)
        start = sum(counts[:pp_rank])
        whole = MegatronGPT(gpt, mesh.get_group("tp"))
        self.stage = MegatronStage(whole, range(start, start + counts[pp_rank]), pp_rank == 0, pp_rank == pp - 1)
        # With two stages the pp group is exactly the first and last stage: the ranks holding the tied table.
        self.pp_group = mesh.get_group("pp")
        self._pipe = PipelineStage(self.stage, pp_rank, pp, device, group=self.pp_group)
        self._new_schedule = functools.partial(SCHEDULE_CLASSES[schedule], self._pipe, microbatches, loss_fn=loss_fn)
        self.rebuild = rebuild
        self._schedule = self._new_schedule()

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor | None:
        """Forward and backward over every microbatch; the mean microbatch loss on the last stage, else None."""
        schedule = self._new_schedule() if self.rebuild else self._schedule
        losses: list[torch.Tensor] = []
        args = (x,) if self.stage.first else ()
        kwargs = {"target": y, "losses": losses} if self.stage.last else {}
        schedule.step(*args, **kwargs)
        dist.all_reduce(self.stage.wte.weight.grad, group=self.pp_group)
        return torch.stack(losses).mean().detach() if losses else None


def _autotp_step(pm: nn.Module, x, y):
    zero_grad(pm)
    return pm.step(x, target=y, loss_fn=loss_fn)


def _hand_step(hand: HandPipeline, x, y):
    zero_grad(hand)
    return hand.step(x, y)


def _accumulated_step(model: nn.Module, x, y, microbatches: int) -> torch.Tensor:
    zero_grad(model)
    losses = []
    for xs, ys in zip(x.chunk(microbatches), y.chunk(microbatches)):
        loss = loss_fn(model(xs), ys) / microbatches
        loss.backward()
        losses.append(loss.detach())
    return torch.stack(losses).sum()


def autotp_variant(model, x, tp: int, pp: int, microbatches: int, schedule: str, name: str = "autotp",
                   **plan_options) -> Variant:
    """autotp at tp x pp over the whole default group; ``plan_options``: ``cuts``, ``balance``."""
    pm = autotp.parallelize(model, tp=tp, pp=pp, example_inputs=(x,), microbatches=microbatches,
                            schedule=schedule, **plan_options)
    return Variant(name, pm, frozenset(range(tp * pp)), _autotp_step)


def hand_variant(model, cfg: BenchConfig, mesh: DeviceMesh, microbatches: int, schedule: str,
                 rebuild: bool = False) -> Variant:
    """The hand-written pipeline over ``mesh`` (every rank of the default group)."""
    hand = HandPipeline(model, mesh, microbatches, schedule, device_of(cfg), rebuild)
    return Variant("megatron_pp", hand, frozenset(range(mesh.size())), _hand_step)


def accumulated_variant(model, microbatches: int, rank: int = 0) -> Variant:
    """The unsharded model on one rank, the batch stepped as ``microbatches`` accumulated microbatches."""
    step = functools.partial(_accumulated_step, microbatches=microbatches)
    return Variant(f"single_mb{microbatches}", model, frozenset({rank}), step)


def loss_everywhere(loss: torch.Tensor | None, cfg: BenchConfig) -> float:
    """The loss some ranks returned (the last stage's), on every rank (collective)."""
    t = torch.tensor([float(loss) if loss is not None else float("-inf")], dtype=torch.float64,
                     device=device_of(cfg))
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def check_losses(variants: dict[str, Variant], reference: float, x, y, cfg: BenchConfig,
                 must_match: tuple[str, ...] = ()) -> dict[str, dict]:
    """One step of each variant: its loss against the single model's (also the first warm-up step).

    A mismatch of a ``must_match`` variant (a hand-written reference, in fp32) stops the run: its
    timing would not be a fair reference.
    """
    checks = {}
    for name, v in variants.items():
        loss = loss_everywhere(run_step(v, x, y), cfg)
        diff = abs(loss - reference) / max(1.0, abs(reference))
        checks[name] = {"loss": loss, "reference": reference, "rel_diff": diff, "ok": diff <= TOLERANCE[cfg.dtype]}
        if name in must_match and cfg.dtype == "fp32" and not checks[name]["ok"]:
            raise RuntimeError(f"{name}'s loss {loss:.6f} differs from the single model's {reference:.6f}")
    return checks
