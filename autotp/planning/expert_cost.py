"""What expert parallelism (``ep``) changes in a layout's predicted step and memory: pure functions over the
mixture-of-experts layers of a ``layout_cost.Profile`` (no torch here).

A profile is planned at ep=1: every routed expert's matrices split by tp (Megatron's all-reduce minimum). A
layout with ``ep > 1`` divides the routed experts among ``ep`` ranks taken from the dp x tp ranks (Megatron's
expert-model-parallel group: ep divides dp x tp and every layer's experts), each rank holding ``E / ep`` whole
experts, and prices, per MoE layer:

- **communication**: a dispatch and a combine all-to-all forward and the same two backward, per microbatch, each
  carrying top-k x the rank's tokens x hidden (a tensor-parallel group's tokens shared among its ranks, as
  Megatron dispatches them with sequence parallelism), over the ep group's link (NVLink when the ep consecutive
  ranks fit in a node, InfiniBand otherwise). The tensor-parallel collectives of the layer are kept (Megatron
  gathers the tokens over tp around the dispatch at tp > 1), so ep never looks cheaper than it is there;
- **memory**: ``E / ep`` whole experts per rank, against ``1 / tp`` of every expert; their gradients reduced over
  the ``dp x tp / ep`` ranks that hold the same experts (and under fsdp their states sharded over them at
  ``ep = tp``; above tp FSDP leaves the experts whole, ``layout_cost._expert_group``);
- **compute**: the routing's expected load (``tokens x top-k / E`` rows per expert) is the same FLOPs per rank
  either way, but the matmuls differ in shape: under tp each expert's matmul is ``rows x width / tp``, under ep
  ``rows x ep / tp`` by the whole ``width``. A matmul with a dimension under the machine's ``tile`` runs at that
  dimension over the tile of its rate (``tile_efficiency``), which is what makes tiny tensor-split experts slow.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MoeLayer:
    """One mixture-of-experts layer of a profile: what expert parallelism would divide, for the global batch."""

    unit: int
    """The unit (between pipeline cut candidates) holding the layer."""
    experts: int
    """Routed experts."""
    top_k: int
    """Experts each token is routed to."""
    hidden: int
    """Features of a token sent to an expert."""
    width: int
    """The smallest dim of one expert's matrices (its hidden width): what tp divides."""
    params: float
    """Elements of the routed experts' parameters, whole."""
    rank_params: float
    """Elements of them one tensor-parallel rank holds in the profile (at ep=1)."""
    tokens: float
    """Tokens of the global batch."""

    @property
    def flops(self) -> float:
        """Forward FLOPs of the routed experts for the global batch at the expected load: each token's k experts,
        a multiply-add per weight element."""
        return 2 * self.tokens * self.top_k * self.params / self.experts


def ep_sizes(moe: tuple[MoeLayer, ...], tp: int, dp: int, fixed: int | None = None) -> list[int]:
    """The ep a layout of ``tp x dp`` ranks may take: 1, and every ep > 1 dividing dp x tp and every layer's
    experts (``fixed``: only that one, where it is valid)."""
    ranks = tp * dp
    valid = [e for e in range(1, ranks + 1) if ranks % e == 0 and (e == 1 or (moe and all(
        layer.experts % e == 0 for layer in moe)))]
    return [e for e in valid if e == fixed] if fixed is not None else valid


def tile_efficiency(rows: float, cols: float, tile: int) -> float:
    """The fraction of a device's matmul rate a ``rows x cols`` output reaches: a dimension under one ``tile``
    leaves the rest of the tile idle (an assumption of this model, not a measurement)."""
    if tile <= 1:
        return 1.0
    return min(1.0, max(min(rows, cols), 1e-9) / tile)


def expert_rows_cols(layer: MoeLayer, tp: int, ep: int, replicas: int, microbatches: int) -> tuple[float, float]:
    """(rows, cols) of one expert's matmul per microbatch at the expected load: under tp (ep=1) its rows are the
    tensor-parallel group's tokens routed to it, its cols ``width / tp``; under ep a rank receives its experts'
    rows from the ep group's ranks, each sending the routed rows of its ``1 / tp`` share of the tokens."""
    tokens = layer.tokens / (replicas * microbatches)
    per_expert = tokens * layer.top_k / layer.experts
    if ep == 1:
        return per_expert, layer.width / tp
    return per_expert * ep / tp, float(layer.width)


def slowdown_flops(layer: MoeLayer, tp: int, ep: int, dp: int, microbatches: int, tile: int) -> float:
    """Forward FLOPs per rank the expert matmuls' tile efficiency adds (0 when every dimension fills a tile)."""
    efficiency = tile_efficiency(*expert_rows_cols(layer, tp, ep, dp, microbatches), tile)
    return layer.flops / (tp * dp) * (1 / efficiency - 1)


def dispatch_bytes(layer: MoeLayer, tp: int, dp: int, microbatches: int, itemsize: int) -> float:
    """Bytes one rank sends in one all-to-all of one microbatch: top-k x its tokens x hidden."""
    return layer.top_k * layer.tokens / (dp * microbatches * tp) * layer.hidden * itemsize


ALL_TO_ALLS = 4
"""All-to-alls per MoE layer and microbatch: dispatch and combine forward, their gradients backward."""
