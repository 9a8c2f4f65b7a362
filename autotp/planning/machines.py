"""Named machines the layout search plans for: a device's compute and memory, and the two links between devices
(within a node, between nodes), each a ``pricing.Machine`` so that every cost is priced by the one model.

A group of ranks communicates over the node's link when it lies within one node, else over the network. Ranks lie
on the (pp, dp, tp) mesh with tp innermost (``runtime.mesh``), so a tp group spans ``tp`` consecutive ranks, a dp
group ``tp * dp`` and a pp group all of them: ``Cluster.link(size, stride)`` tells which link a group uses.

GPU figures are published ones, not measured here: the dense bf16 peak times a model-FLOPs utilisation (MFU) that
large training runs report (Llama 3 405B: 38-43% on H100; torchtitan: 30-45%), and NCCL's bus bandwidth, which
is what a ring all-reduce of large messages reaches (``2(n-1)/n * bytes / busbw``, as ``Machine.all_reduce``).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import torch

from autotp.errors import InputError
from autotp.planning.pricing import CPU, Machine

MFU = 0.4
"""Fraction of the dense bf16 peak a training step reaches on GPUs (Llama 3 405B reports 38-43% on H100)."""

LAUNCH = 5e-6
"""Seconds an eager op costs on a GPU regardless of its size (a kernel launch and its dispatch)."""


@dataclass(frozen=True)
class Cluster:
    """Devices of one kind, ``devices_per_node`` to a node: their compute, memory and links."""

    name: str
    description: str
    node: Machine
    """Compute rate of one device, and collectives within a node (NVLink; gloo over shared memory)."""
    network: Machine
    """Collectives between nodes (InfiniBand): the same compute rate, the network's bandwidth and latency."""
    devices_per_node: int
    device_memory: int | None
    """Bytes of memory per device (None: not limited)."""
    cores: float | None = None
    """Ranks that compute at once: a host's cores when its ranks are processes on one CPU (more ranks than cores
    time-share them, ``layout_cost.shared_cores``; a calibration may find a fraction of them free); None: a
    device per rank (GPUs)."""

    def link(self, size: int, stride: int) -> Machine:
        """The machine a group of ``size`` ranks, ``stride`` apart on the mesh, communicates over: the node's
        when the ranks it spans fit in one node."""
        return self.node if size * stride <= self.devices_per_node else self.network

    def ring(self, size: int, stride: int) -> Machine:
        """``link`` for a ring collective over the group: a ``Machine``'s latency is a two-rank collective's, and
        a ring of ``size`` ranks takes ``size - 1`` times as many hops."""
        machine = self.link(size, stride)
        return dataclasses.replace(machine, latency=machine.latency * max(1, size - 1))


def _gpu(name: str, peak: float, nvlink: float, network: float, memory_gib: int, per_node: int = 8) -> Cluster:
    """A GPU cluster from published figures: bf16 dense ``peak`` FLOP/s, NVLink and per-GPU network bus bandwidth
    in bytes/s (NCCL latencies: ~10 us within a node, ~30 us across InfiniBand)."""
    flops = peak * MFU
    return Cluster(name, f"{per_node}x {name.upper()} per node, bf16 {peak / 1e12:.0f} TFLOPS at {MFU:.0%} MFU, "
                         f"NVLink {nvlink / 1e9:.0f} GB/s, network {network / 1e9:.0f} GB/s per GPU",
                   Machine(f"{name} NVLink", flops, nvlink, 1e-5, LAUNCH),
                   Machine(f"{name} InfiniBand", flops, network, 3e-5, LAUNCH),
                   per_node, memory_gib * 2**30)


CLUSTERS = {
    "cpu": Cluster("cpu", f"CPU processes over gloo on one host of {os.cpu_count()} cores (calibrated: bench.layouts)",
                   CPU, CPU, 1 << 30, None, os.cpu_count() or 1),
    # NVLink 4: 900 GB/s bidirectional, 450 per direction; InfiniBand NDR 400 Gb/s = 50 GB/s per GPU, one NIC each.
    "h100": _gpu("h100", 989e12, 450e9, 50e9, 80),
    "h200": _gpu("h200", 989e12, 450e9, 50e9, 141),
    # NVLink 3: 600 GB/s bidirectional; InfiniBand HDR 200 Gb/s = 25 GB/s per GPU.
    "a100": _gpu("a100", 312e12, 300e9, 25e9, 80),
}
"""The machines ``--machine`` names."""


def cluster_named(name: str) -> Cluster:
    """The machine called ``name`` (``InputError`` listing the names otherwise)."""
    if name not in CLUSTERS:
        raise InputError(f"unknown machine {name!r}; the machines are: {', '.join(CLUSTERS)}")
    return CLUSTERS[name]


def cluster_for(device: torch.device | str | None) -> Cluster:
    """The machine ranks on ``device`` run on: this CPU over gloo, else the GPU this process sees (an unknown
    GPU is priced as an H100)."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if torch.device(device).type != "cuda":
        return CLUSTERS["cpu"]
    gpu = torch.cuda.get_device_name(device).lower()
    return next((c for n, c in CLUSTERS.items() if n in gpu and n != "cpu"), CLUSTERS["h100"])
