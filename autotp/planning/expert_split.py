"""What ``ep`` (expert parallelism) does to a plan's mixture-of-experts layers, as notes: each layer found from its
router (``passes.routed_experts``) is named with its experts, and with why its experts stay under tensor
parallelism at this ``ep``.

Giving each of ``ep`` ranks whole experts (tokens dispatched to their experts' ranks by all-to-all) is not yet
done by the rewrite, so every layer keeps its experts split by tensor parallelism, Megatron's all-reduce minimum,
exact; the notes say so, layer by layer, so a plan made with ``ep`` never reads as expert-split when it is not.
"""

from __future__ import annotations

from autotp.passes.routed_experts import ExpertLayer

NOT_YET = ("autotp's rewrite does not yet give ranks whole experts (all-to-all dispatch); they stay split by "
           "tensor parallelism, exact, with one all-reduce of the hidden state each way")
"""Why a layer whose experts divide among the ``ep`` ranks still keeps them under tensor parallelism."""


def why_kept(layer: ExpertLayer, ep: int) -> str:
    """Why ``layer``'s routed experts stay under tensor parallelism at ``ep`` expert-parallel ranks."""
    if layer.experts % ep:
        return (f"its {layer.experts} experts do not divide among ep={ep} ranks; use an ep that divides "
                f"{layer.experts}")
    return NOT_YET


def expert_notes(layers: tuple[ExpertLayer, ...], ep: int) -> list[str]:
    """The plan notes ``ep`` adds for ``layers`` (none at ep=1): one per layer, and one when there is no layer to
    split."""
    if ep == 1:
        return []
    if not layers:
        return [f"ep={ep}: the model has no mixture-of-experts router, so there are no routed experts to divide "
                "among ranks; ep changes nothing"]
    return [f"{layer.module}: {layer.experts} routed experts (top-{layer.top_k}, routed by {layer.router}) kept "
            f"under tensor parallelism at ep={ep}: {why_kept(layer, ep)}" for layer in layers]
