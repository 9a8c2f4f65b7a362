"""What ``ep`` (expert parallelism) does to a plan's mixture-of-experts layers. Each layer is found from its router
(``passes.routed_experts``); a bank its experts' grouped matmuls read (``passes.grouped_banks``) is placed
``PlacementKind.EXPERT`` when ``ep`` is a multiple of ``tp`` (an expert-parallel group holds whole tensor-parallel
groups, each of whose ranks dispatches its share of the rows by all-to-all) and ``ep`` divides its experts.
Every layer gets a note: its experts divided among the ranks, or why they stay split by tensor parallelism
(Megatron's all-reduce minimum, exact), so a plan never reads as expert-split where it is not.
"""

from __future__ import annotations

from autotp.passes.placement import Placement, PlacementKind
from autotp.passes.routed_experts import ExpertLayer

NO_BANK = ("its experts are neither grouped matmuls over a bank of their matrices nor a loop over the experts reading "
           "their slices of banks (the structures expert parallelism splits): experts written as a list of modules "
           "hold each expert's matrices as separate parameters, which a plan splits along their dims on every rank "
           "and cannot hold whole on some ranks only; a batched matmul over a bank (gathered per token, "
           "W[expert_ids], or every token through every expert, as Llama 4's) and a static loop over rows split by "
           "expert (JetMoE's) are not split by experts yet. They stay split by tensor parallelism, exact")
"""Why a layer whose experts are written otherwise (a list of modules, a batched matmul) keeps tensor parallelism."""

NOT_TP = ("an expert-parallel group must hold whole tensor-parallel groups (each tp rank dispatches its share of the "
          "rows), so ep must be a multiple of tp; use ep = tp or a multiple of it. The experts stay split by tensor "
          "parallelism, exact")
"""Why a layer keeps tensor parallelism when ``ep`` is not a multiple of ``tp``."""

EXPERT = Placement(PlacementKind.EXPERT, dim=0)
"""A bank split by its experts (its first dim)."""


def why_kept(layer: ExpertLayer, ep: int, tp: int, banked: bool) -> str | None:
    """Why ``layer``'s routed experts stay under tensor parallelism at ``ep`` (None: they are expert-split)."""
    if layer.experts % ep:
        return f"its {layer.experts} experts do not divide among ep={ep} ranks; use an ep that divides {layer.experts}"
    if ep % tp:
        return NOT_TP
    return None if banked else NO_BANK


def expert_banks(layers: tuple[ExpertLayer, ...], banks: dict[str, int], ep: int, tp: int) -> dict[str, Placement]:
    """The banks (parameter name -> experts) to place ``EXPERT``: those of a layer whose experts can be split."""
    out = {}
    for layer in layers:
        own = {n: e for n, e in banks.items() if layer.owns(n)}
        if own and why_kept(layer, ep, tp, True) is None and all(e % ep == 0 for e in own.values()):
            out |= dict.fromkeys(own, EXPERT)
    return out


def expert_notes(layers: tuple[ExpertLayer, ...], ep: int, tp: int, split: set[str],
                 loops_kept: tuple[str, ...] = ()) -> list[str]:
    """The plan notes ``ep`` adds for ``layers`` (none at ep=1), given the parameter names placed ``EXPERT``: one
    per layer, and one when there is no layer to split. ``loops_kept``: why each loop over the experts reading
    banks was not split (``passes.loop_banks``)."""
    if ep == 1:
        return []
    if not layers:
        return [f"ep={ep}: the model has no mixture-of-experts router, so there are no routed experts to divide "
                "among ranks; ep changes nothing"]
    notes = []
    for layer in layers:
        own = sorted(n for n in split if layer.owns(n))
        head = f"{layer.module}: {layer.experts} routed experts (top-{layer.top_k}, routed by {layer.router})"
        if own:
            notes.append(f"{head} divided among ep={ep} ranks, {layer.experts // ep} whole experts each "
                         f"({', '.join(own)}): the routed rows go to their experts' ranks and back by all-to-all "
                         "(dispatch and combine, forward and backward), nothing summed over ranks")
        else:
            why = why_kept(layer, ep, tp, False)
            if why == NO_BANK and loops_kept:
                why = (f"its experts are a loop over the experts whose chains cannot move to other ranks "
                       f"({loops_kept[0]}); they stay split by tensor parallelism, exact")
            notes.append(f"{head} kept under tensor parallelism at ep={ep}: {why}")
    return notes
