"""Export a plan to other runtimes: a Hugging Face ``tp_plan`` dict and a torch ``parallelize_module`` plan.

Both express a plan per module, with a fixed menu of styles; autotp's plan is per parameter and can say
more. What translates:

============================  ===========================  =================================================
autotp                        Hugging Face ``tp_plan``     torch ``parallelize_module``
============================  ===========================  =================================================
column-split Linear           ``colwise``                  ``ColwiseParallel()``
row-split Linear              ``rowwise``                  ``RowwiseParallel()``
vocab-split embedding         ``embedding_rowwise``        ``RowwiseParallel(input_layouts=Replicate())``
vocab-split LM head           ``colwise_gather_output``    ``ColwiseParallel(output_layouts=Replicate())``
fused weight of 2 equal parts ``packed_colwise``           (none)
============================  ===========================  =================================================

What does not: convolutions split by channels, a fused weight of other parts (nanoGPT's QKV ``c_attn``: each rank needs a share of Q,
of K and of V, but those styles cut contiguous blocks), weights stored transposed (HF's ``Conv1D``),
bare parameters (``x @ W``), and K/V kept whole when tp does not divide the KV heads. The whole region
(say, an attention) of such a module is then left out, so what is exported still computes the same
function, only less split; ``strict=True`` (the default) raises ``PlanError`` naming them instead.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from autotp.errors import PlanError
from autotp.names import block_pattern, within
from autotp.passes.region_match import RegionKind
from autotp.planning import PlacementKind, Plan, Region
from autotp.tools.report import module_params


class Target(str, Enum):
    """The runtime a plan is exported to."""

    HF = "hf"
    """transformers' ``tp_plan`` (``DistributedConfig(tp_plan=...)``, ``model.tp_plan``)."""
    TORCH = "torch"
    """torch's ``parallelize_module(model, mesh, plan)``."""


@dataclass(frozen=True)
class Export:
    """Module name -> style, and the modules left replicated with the reason why."""

    styles: dict[str, str] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)


_PACKED = "packed"
"""The role of a column-split weight of two equal fused parts (HF's ``packed_colwise``)."""

_ROLE_STYLES = {
    Target.HF: {PlacementKind.COLWISE: "colwise", PlacementKind.ROWWISE: "rowwise",
                RegionKind.EMBEDDING: "embedding_rowwise", RegionKind.LM_HEAD: "colwise_gather_output",
                _PACKED: "packed_colwise"},
    Target.TORCH: {PlacementKind.COLWISE: "colwise", PlacementKind.ROWWISE: "rowwise",
                   RegionKind.EMBEDDING: "embedding", RegionKind.LM_HEAD: "head"},
}
"""What each target calls a member of a region: keyed by its placement kind, or for the vocabulary-split
layers by their region kind (an embedding and a head are split along the vocabulary differently)."""

Role = PlacementKind | RegionKind


def _roles(region: Region) -> list[tuple[str, Role]]:
    if region.kind in (RegionKind.EMBEDDING, RegionKind.LM_HEAD):
        return [(m, region.kind) for m in region.columns]
    return [(m, PlacementKind.COLWISE) for m in region.columns] + [(m, PlacementKind.ROWWISE) for m in region.rows]


def _expected(role: Role) -> tuple[PlacementKind, int]:
    """The placement and split dim of nn.Linear's / nn.Embedding's weight in this role."""
    if role is PlacementKind.ROWWISE:
        return PlacementKind.ROWWISE, 1
    return (PlacementKind.COLWISE, 0) if role is PlacementKind.COLWISE else (PlacementKind.VOCAB, 0)


def _member_style(plan: Plan, module: str, role: Role, target: Target) -> tuple[str | None, str]:
    """(style, '') when ``target`` can express this module's placement, else (None, why not)."""
    weight = f"{module}.weight"
    if weight not in plan.placements:
        return None, "is a bare parameter, not a module's weight (these styles shard nn.Linear/nn.Embedding modules)"
    placement = plan.placements[weight]
    if (placement.kind, placement.dim) != _expected(role):
        return None, (f"has its weight split along dim {placement.dim}; these styles expect nn.Linear's [out, in] "
                      "layout (a transposed weight, such as HF's Conv1D, cannot be expressed)")
    if placement.segments:
        parts = placement.segments
        if target is Target.HF and len(parts) == 2 and parts[0] == parts[1]:
            return _ROLE_STYLES[target][_PACKED], ""
        return None, (f"is a fused weight of {len(parts)} parts {list(parts)}: each rank needs a share of every part, "
                      "but these styles cut one contiguous block per rank")
    return _ROLE_STYLES[target][role], ""


def _region_styles(plan: Plan, region: Region, target: Target) -> tuple[dict[str, str], str]:
    if region.kind is RegionKind.ROW:
        return {}, ("is split alone by its input features, reading a whole input it slices itself; these styles' "
                    "rowwise expects an input that is already split")
    if region.kind is RegionKind.CONVOLUTION:
        return {}, ("splits convolutions by channels (and the norms between them), which these styles, made for "
                    "nn.Linear and nn.Embedding, cannot express")
    if region.replicated:
        return {}, (f"tp={plan.tp} does not divide the KV heads, so autotp keeps {', '.join(region.replicated)} "
                    "whole and each rank slices its heads; these styles cannot express that")
    styles = {}
    for module, role in _roles(region):
        style, why = _member_style(plan, module, role, target)
        if style is None:
            return {}, f"{module} {why}"
        styles[module] = style
    return styles, ""


def _owner(param: str) -> str:
    return param.rpartition(".")[0]


def _under(modules, parent: str) -> bool:
    return any(within(m, parent) for m in modules)


def export_styles(plan: Plan, target: Target) -> Export:
    """Every module ``target`` can shard as the plan does, and each region left out with its reason."""
    decided = [(region, *_region_styles(plan, region, target)) for region in plan.regions]
    members = {p for r in plan.regions for m in (*r.columns, *r.rows, *r.replicated) for p in module_params(plan, m)}
    # A split parameter that belongs to no region member (a hand-added bias, say) would stay whole while
    # its region is split: leave out every region under the same parent so the export stays exact.
    for param, placement in plan.placements.items():
        if placement.is_split and param not in members:
            why = f"split parameter {param} is not a weight or bias of the region's modules"
            decided = [(r, {}, why) if _under(styles, _owner(param)) else (r, styles, w) for r, styles, w in decided]
    shared = {p for p, placement in plan.placements.items() if placement.replicas != 1}
    decided = [(r, {}, "its K/V heads are shared by several ranks (tp above the KV heads), which no sharding "
                "style expresses") if shared & {p for m in (*r.columns, *r.rows) for p in module_params(plan, m)}
               else (r, styles, why) for r, styles, why in decided]
    experts = {p for p, placement in plan.placements.items() if placement.kind is PlacementKind.EXPERT}
    decided = [(r, {}, "its experts are divided among the ranks (expert parallelism), which no tensor-parallel "
                "sharding style expresses") if experts & {p for m in (*r.columns, *r.rows) for p in module_params(plan, m)}
               else (r, styles, why) for r, styles, why in decided]
    out = Export()
    for region, styles, why in decided:
        out.styles.update(styles)
        if why:
            out.skipped.update({m: why for m in (*region.columns, *region.rows, *region.replicated)})
    return out


def _checked(plan: Plan, target: Target, strict: bool) -> Export:
    exported = export_styles(plan, target)
    if strict and exported.skipped:
        module, why = next(iter(exported.skipped.items()))
        raise PlanError(f"the {target.value} export cannot express {len(exported.skipped)} module(s) of this plan, "
                        f"first {module} ({why}); pass strict=False to leave their regions replicated")
    return exported


def wildcard_styles(styles: dict[str, str], modules: set[str]) -> dict[str, str]:
    """Write ``layers.0.x``, ``layers.1.x``, ... as ``layers.*.x`` where every module the pattern
    matches in ``modules`` has the same style (so the pattern shards nothing the plan keeps whole)."""
    by_pattern: dict[str, set[str]] = {}
    for module in modules:
        by_pattern.setdefault(block_pattern(module), set()).add(module)
    out: dict[str, str] = {}
    for module, style in styles.items():
        pattern = block_pattern(module)
        same = {styles.get(m) for m in by_pattern.get(pattern, {module})} == {style}
        out[pattern if same else module] = style
    return out


def to_hf_tp_plan(plan: Plan, strict: bool = True, wildcards: bool = True) -> dict[str, str]:
    """The plan as a Hugging Face ``tp_plan``: full module names (``model.layers.*.self_attn.q_proj``) -> style.

    Keys are relative to the model the plan was made from, like ``model.tp_plan``; repeated layers are
    written with ``*`` as Hugging Face does. ``strict=False`` leaves out regions HF cannot express.
    """
    styles = _checked(plan, Target.HF, strict).styles
    if not wildcards:
        return styles
    return wildcard_styles(styles, {_owner(p) or p for p in plan.placements})


def torch_style(style: str):
    """The torch ``ParallelStyle`` object for an exported style word."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {"colwise": ColwiseParallel, "rowwise": RowwiseParallel,
            "embedding": lambda: RowwiseParallel(input_layouts=Replicate()),
            "head": lambda: ColwiseParallel(output_layouts=Replicate())}[style]()


TORCH_SOURCE = {"colwise": "ColwiseParallel()", "rowwise": "RowwiseParallel()",
                "embedding": "RowwiseParallel(input_layouts=Replicate())",
                "head": "ColwiseParallel(output_layouts=Replicate())"}
"""How each torch style is written in Python source."""


def to_torch_plan(plan: Plan, strict: bool = True) -> dict:
    """The plan for ``torch.distributed.tensor.parallel.parallelize_module``: module name -> ParallelStyle.

    Your forward must then take head counts from the local shapes (``view(B, T, -1, head_dim)``):
    torch shards the weights but, unlike autotp's rewrite, does not fix constants such as ``n_head``.
    """
    return {m: torch_style(s) for m, s in _checked(plan, Target.TORCH, strict).styles.items()}


def torch_plan_source(plan: Plan) -> str:
    """Python source building the torch plan (non-strict), with the left-out modules as comments."""
    exported = export_styles(plan, Target.TORCH)
    lines = ["from torch.distributed.tensor import Replicate",
             "from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module",
             "", "plan = {"]
    lines += [f"    {m!r}: {TORCH_SOURCE[s]}," for m, s in exported.styles.items()]
    lines += ["}"]
    by_reason: dict[str, list[str]] = {}
    for module, why in exported.skipped.items():
        by_reason.setdefault(why, []).append(module)
    lines += [f"# left replicated: {', '.join(ms)}: {why}" for why, ms in by_reason.items()]
    lines += ["# parallelize_module(model, tp_mesh, plan)"]
    return "\n".join(lines)
