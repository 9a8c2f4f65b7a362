"""The hardware model every cost is priced on: a ``Machine`` is a device's compute and memory and the two links
between devices (within a node, between nodes), each a ``Link``. The planner prices a tensor-parallel group's
collectives on the node's link; the layout search prices every group on the link it spans. ``MACHINES`` names the
machines ``--machine`` knows; ``machine_for`` is the one ranks on a device run on.

A group of ranks communicates over the node's link when it lies within one node, else over the network. Ranks lie
on the (pp, dp, tp) mesh with tp innermost (``runtime.mesh``), so a tp group spans ``tp`` consecutive ranks, a dp
group ``tp * dp`` and a pp group all of them: ``Machine.link(size, stride)`` tells which link a group uses.

GPU figures are published ones, not measured here: the dense bf16 peak times a model-FLOPs utilisation (MFU) that
large training runs report (Llama 3 405B: 38-43% on H100; torchtitan: 30-45%), and NCCL's bus bandwidth, which
is what a ring all-reduce of large messages reaches (``2(n-1)/n * bytes / busbw``, as ``Link.all_reduce``).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import torch

from autotp.errors import InputError

MFU = 0.4
"""Fraction of the dense bf16 peak a training step reaches on GPUs (Llama 3 405B reports 38-43% on H100)."""

LAUNCH = 5e-6
"""Seconds an eager op costs on a GPU regardless of its size (a kernel launch and its dispatch)."""


@dataclass(frozen=True)
class Link:
    """What the cost model assumes of ranks joined by one link: a rank's compute rate and a collective's cost."""

    name: str
    flops: float
    """Matmul FLOP/s of one rank."""
    bandwidth: float
    """Bytes/s one rank sends in a ring collective."""
    latency: float
    """Seconds a collective costs regardless of its size."""
    op_overhead: float = 0.0
    """Seconds each op costs regardless of its size (eager dispatch and autograd; a kernel launch on GPUs)."""
    tile: int = 1
    """Rows (and columns) a matmul's output needs in each dimension to reach ``flops``: a GPU's tensor-core tile
    (1: any size does, as on CPUs, where the per-op cost dominates small matmuls instead)."""

    def compute(self, flops: float, ops: float = 0) -> float:
        """Seconds for ``flops`` spread over ``ops`` ops."""
        return flops / self.flops + ops * self.op_overhead

    def all_reduce(self, nbytes: float, tp: int) -> float:
        """Seconds for a ring all-reduce of ``nbytes`` over ``tp`` ranks."""
        return self.latency + 2 * (tp - 1) / tp * nbytes / self.bandwidth

    def all_gather(self, nbytes: float, tp: int) -> float:
        """Seconds for a ring all-gather whose result is ``nbytes``."""
        return self.latency + (tp - 1) / tp * nbytes / self.bandwidth

    def all_to_all(self, nbytes: float, ranks: int) -> float:
        """Seconds for an all-to-all in which each of ``ranks`` ranks sends ``nbytes``, spread evenly: all but its
        own share leave it, the pairs' exchanges at once (one latency)."""
        return self.latency + (ranks - 1) / ranks * nbytes / self.bandwidth


CPU = Link("CPU processes over gloo", flops=5e10, bandwidth=6e8, latency=1e-3, op_overhead=7e-5)
"""Measured on the 2-core development machine (bench.vocab_choice prints the calibration): a 512x256 by
256x8192 fp32 matmul at ~55 GFLOP/s on one thread; a gloo all-reduce of 512 KiB ~1.9 ms, of 2 MiB ~4.5 ms;
an eager op ~70 us forward or backward (bench.layouts' calibration: a narrow GPT's step over its graph's ops,
on the machine shared with other work, load average ~20)."""


@dataclass(frozen=True)
class Machine:
    """Devices of one kind, ``devices_per_node`` to a node: their compute, memory and links."""

    name: str
    description: str
    node: Link
    """Compute rate of one device, and collectives within a node (NVLink; gloo over shared memory)."""
    network: Link
    """Collectives between nodes (InfiniBand): the same compute rate, the network's bandwidth and latency."""
    devices_per_node: int
    device_memory: int | None
    """Bytes of memory per device (None: not limited)."""
    cores: float | None = None
    """Ranks that compute at once: a host's cores when its ranks are processes on one CPU (more ranks than cores
    time-share them, ``layout_cost.shared_cores``; a calibration may find a fraction of them free); None: a
    device per rank (GPUs)."""

    def link(self, size: int, stride: int) -> Link:
        """The link a group of ``size`` ranks, ``stride`` apart on the mesh, communicates over: the node's
        when the ranks it spans fit in one node."""
        return self.node if size * stride <= self.devices_per_node else self.network

    def ring(self, size: int, stride: int) -> Link:
        """``link`` for a ring collective over the group: a ``Link``'s latency is a two-rank collective's, and
        a ring of ``size`` ranks takes ``size - 1`` times as many hops."""
        link = self.link(size, stride)
        return dataclasses.replace(link, latency=link.latency * max(1, size - 1))


TILE = 128
"""Rows and columns a GPU matmul's output needs in each dimension to keep its tensor cores busy: H100's wgmma
tiles are 64 to 256 wide, cuBLAS's common 128 x 128 (an assumption of the cost model, not measured here)."""


def _gpu(name: str, peak: float, nvlink: float, network: float, memory_gib: int, per_node: int = 8) -> Machine:
    """A GPU machine from published figures: bf16 dense ``peak`` FLOP/s, NVLink and per-GPU network bus bandwidth
    in bytes/s (NCCL latencies: ~10 us within a node, ~30 us across InfiniBand)."""
    flops = peak * MFU
    return Machine(name, f"{per_node}x {name.upper()} per node, bf16 {peak / 1e12:.0f} TFLOPS at {MFU:.0%} MFU, "
                         f"NVLink {nvlink / 1e9:.0f} GB/s, network {network / 1e9:.0f} GB/s per GPU",
                   Link(f"{name} NVLink", flops, nvlink, 1e-5, LAUNCH, TILE),
                   Link(f"{name} InfiniBand", flops, network, 3e-5, LAUNCH, TILE),
                   per_node, memory_gib * 2**30)


MACHINES = {
    "cpu": Machine("cpu", f"CPU processes over gloo on one host of {os.cpu_count()} cores (calibrated: bench.layouts)",
                   CPU, CPU, 1 << 30, None, os.cpu_count() or 1),
    # NVLink 4: 900 GB/s bidirectional, 450 per direction; InfiniBand NDR 400 Gb/s = 50 GB/s per GPU, one NIC each.
    "h100": _gpu("h100", 989e12, 450e9, 50e9, 80),
    "h200": _gpu("h200", 989e12, 450e9, 50e9, 141),
    # NVLink 3: 600 GB/s bidirectional; InfiniBand HDR 200 Gb/s = 25 GB/s per GPU.
    "a100": _gpu("a100", 312e12, 300e9, 25e9, 80),
}
"""The machines ``--machine`` names."""


def machine_named(name: str) -> Machine:
    """The machine called ``name`` (``InputError`` listing the names otherwise)."""
    if name not in MACHINES:
        raise InputError(f"unknown machine {name!r}; the machines are: {', '.join(MACHINES)}")
    return MACHINES[name]


def machine_for(device: torch.device | str | None = None) -> Machine:
    """The machine ranks on ``device`` run on (default: CUDA when this process sees a GPU): this CPU over gloo,
    else the GPU this process sees (an unknown GPU is priced as an H100)."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if torch.device(device).type != "cuda":
        return MACHINES["cpu"]
    gpu = torch.cuda.get_device_name(device).lower()
    return next((m for n, m in MACHINES.items() if n in gpu and n != "cpu"), MACHINES["h100"])
