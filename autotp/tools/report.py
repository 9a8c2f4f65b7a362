"""The plan as a table a person reads: split modules, collectives with bytes, stages, memory totals.

Everything here is a pure function of the ``Plan`` plus the parameter shapes of the model (the plan
is keyed by names and holds no shapes) and the batch and sequence length to cost it at.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from autotp.capture import tensor_aliases
from autotp.errors import PlanError
from autotp.names import block_numbers, block_of, block_pattern, within_any
from autotp.options import DataParallelMode
from autotp.passes.steps import ring_share
from autotp.planning import Collective, Placement, Plan


@dataclass(frozen=True)
class ParamInfo:
    """What the plan does not record about a parameter: its shape and element size."""

    shape: tuple[int, ...]
    itemsize: int
    first_name: str
    """The name the tensor was first seen under (tied parameters share it; count them once)."""

    @property
    def numel(self) -> int:
        """Number of elements."""
        n = 1
        for d in self.shape:
            n *= d
        return n


def param_infos(model: nn.Module) -> dict[str, ParamInfo]:
    """Shape, element size and first name of every parameter, tied ones under each of their names."""
    first = tensor_aliases(model)
    return {name: ParamInfo(tuple(p.shape), p.element_size(), first[name])
            for name, p in model.named_parameters(remove_duplicate=False)}


@dataclass(frozen=True)
class ModuleRow:
    """One split (or deliberately replicated) module: its name, decision and weight shapes."""

    name: str
    kind: str
    full: str
    shard: str


def human_bytes(n: float | None) -> str:
    """``1536`` -> ``1.5 KiB``; None (a size we cannot evaluate) -> ``?``."""
    if n is None:
        return "?"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.3g} {unit}"
        n /= 1024
    return f"{n:.3g} TiB"


def human_count(n: float) -> str:
    """``1.2e9`` -> ``1.2 G``."""
    for unit, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.3g}"


def collective_bytes(c: Collective, batch: int, seq: int) -> int | None:
    """Bytes of the communicated tensor at ``batch``/``seq`` (None when its shape has other symbols)."""
    try:
        return c.nbytes(batch, seq)
    except (PlanError, ValueError):  # a symbol other than B and T (or a size not in the plan language): no size
        return None


def ring_bytes(c: Collective, tp: int, batch: int, seq: int) -> float | None:
    """Bytes each rank sends for ``c`` over a ring: 2(tp-1)/tp of it for an all-reduce, (tp-1)/tp for a gather."""
    size = collective_bytes(c, batch, seq)
    if size is None:
        return None
    return size * ring_share(c.op, tp)


def shard_shape(shape: tuple[int, ...], placement: Placement, tp: int) -> tuple[int, ...]:
    """The shape one rank holds."""
    if not placement.is_split:
        return shape
    return tuple(-(-d // placement.chunks(tp)) if i == placement.dim else d for i, d in enumerate(shape))  # the longest


def _fmt(shape: tuple[int, ...]) -> str:
    return "[" + ", ".join(map(str, shape)) + "]"


def module_params(plan: Plan, module: str) -> list[str]:
    """The plan's parameters that belong directly to ``module`` (or ``module`` itself, a bare parameter)."""
    if module in plan.placements:
        return [module]
    return [n for n in plan.placements if n.rpartition(".")[0] == module]


def region_modules(plan: Plan) -> list[str]:
    """Every module the plan's regions name, in plan order (each once)."""
    names = [m for r in plan.regions for m in (*r.columns, *r.rows, *r.replicated)]
    return list(dict.fromkeys(names))


def module_kind(plan: Plan, module: str) -> str:
    """column/row/vocab/replicated for a module: the placement of its weight (or first split parameter)."""
    params = module_params(plan, module)
    weight = next((p for p in params if p.endswith(".weight") or p == module), None)
    split = [p for p in params if plan.placements[p].is_split]
    chosen = weight if weight and plan.placements[weight].is_split else (split[0] if split else weight)
    return plan.placements[chosen].kind.word if chosen else "replicated"


def module_rows(plan: Plan, params: dict[str, ParamInfo]) -> list[ModuleRow]:
    """One row per module the plan splits or keeps whole on purpose, with full and per-rank shapes."""
    rows = []
    for module in region_modules(plan):
        names = [n for n in module_params(plan, module) if n in params]
        if not names:
            continue
        full = " + ".join(_fmt(params[n].shape) for n in names)
        shard = " + ".join(_fmt(shard_shape(params[n].shape, plan.placements[n], plan.tp)) for n in names)
        rows.append(ModuleRow(module, module_kind(plan, module), full, shard))
    return rows


def _ranges(values: list[int]) -> str:
    values = sorted(values)
    if values == list(range(values[0], values[-1] + 1)):
        return f"{values[0]}-{values[-1]}"
    return ",".join(map(str, values))


def collapse_names(keys: list[tuple[str, tuple]]) -> list[tuple[str, tuple, int]]:
    """Merge entries whose names differ only in block numbers and whose ``payload`` is equal.

    ``keys`` holds (name, payload); returns (``transformer.h.[0-11].attn.c_attn``, payload, count).
    """
    groups: dict[tuple, list[tuple[int, ...]]] = {}
    for name, payload in keys:
        pattern, indices = block_pattern(name, "{}"), block_numbers(name)
        groups.setdefault((pattern, len(indices), payload), []).append(indices)
    out = []
    for (pattern, n_idx, payload), index_lists in groups.items():
        if n_idx == 0 or len(index_lists) == 1:
            out.extend((pattern.format(*idx), payload, 1) for idx in index_lists)
            continue
        columns = list(zip(*index_lists))
        parts = [f"[{_ranges(list(set(col)))}]" if len(set(col)) > 1 else str(col[0]) for col in columns]
        out.append((pattern.format(*parts), payload, len(index_lists)))
    return out


def param_bytes(plan: Plan, params: dict[str, ParamInfo], names=None) -> tuple[float, float]:
    """(bytes one tensor-parallel rank holds, bytes unsharded) over ``names`` (default: all), tied counted once."""
    per_rank = whole = 0.0
    seen = set()
    for name in names if names is not None else params:
        info = params[name]
        if info.first_name in seen:
            continue
        seen.add(info.first_name)
        size = info.numel * info.itemsize
        whole += size
        placement = plan.placements.get(name)
        per_rank += size / placement.chunks(plan.tp) if placement is not None and placement.is_split else size
    return per_rank, whole


def stage_params(plan: Plan, params: dict[str, ParamInfo]) -> list[list[str]]:
    """The parameters each pipeline stage holds (by module prefix)."""
    out = []
    for stage in plan.stages:
        out.append([n for n in params if within_any(n, [m for m in stage.modules if m])])
    return out


def per_rank_param_bytes(plan: Plan, params: dict[str, ParamInfo]) -> float:
    """Parameter bytes of the fullest rank: with stages, the largest stage's share on one tp rank."""
    if not plan.stages:
        return param_bytes(plan, params)[0]
    return max(param_bytes(plan, params, names)[0] for names in stage_params(plan, params))


def step_collectives(plan: Plan) -> list[Collective]:
    """The collectives a training step runs (all but the deferred gathers of model outputs)."""
    return [c for c in plan.collectives if c.in_step]


def step_bytes(plan: Plan, batch: int, seq: int) -> tuple[float, float]:
    """(payload bytes of every collective in one training step, forward and backward, bytes each rank sends over
    a ring). The gathers of model outputs are not in it: ``pm.step`` computes its loss on the split outputs."""
    payload = sum(collective_bytes(c, batch, seq) or 0 for c in step_collectives(plan))
    wire = sum(ring_bytes(c, plan.tp, batch, seq) or 0 for c in step_collectives(plan))
    return payload, wire


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    line = lambda r: "  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip()  # noqa: E731
    return [line(header), line(["-" * w for w in widths]), *(line(r) for r in rows)]


def _module_section(plan: Plan, params: dict[str, ParamInfo], expand: bool) -> list[str]:
    rows = module_rows(plan, params)
    keyed = [(r.name, (r.kind, r.full, r.shard)) for r in rows]
    entries = [(n, p, 1) for n, p in keyed] if expand else collapse_names(keyed)
    body = [[name + (f" (x{count})" if count > 1 else ""), kind, full, shard]
            for name, (kind, full, shard), count in entries]
    return [f"Split modules (tp={plan.tp}):", *_table(["module", "kind", "full shape", "shard shape"], body)]


def _collective_section(plan: Plan, batch: int, seq: int, expand: bool) -> list[str]:
    by_block: dict[str, list[Collective]] = {}
    for c in plan.collectives:
        by_block.setdefault(block_of(c.module) or c.module, []).append(c)
    keyed = []
    for block, items in by_block.items():
        rel = tuple((c.op.value, c.direction.value if c.in_step else "forward, not in step",
                     c.operator.value, c.module.removeprefix(block).lstrip(".") or "-",
                     "x".join(c.shape), human_bytes(collective_bytes(c, batch, seq))) for c in items)
        keyed.append((block, rel))
    entries = [(n, p, 1) for n, p in keyed] if expand else collapse_names(keyed)
    body = []
    for block, rel, count in entries:
        label = block + (f" (each of {count})" if count > 1 else "")
        body.extend([label if i == 0 else "", *row] for i, row in enumerate(rel))
    header = ["block", "op", "pass", "operator", "at", "shape", "bytes"]
    return [f"Collectives per block (bytes at batch {batch}, seq {seq}):", *_table(header, body)]


def _stage_section(plan: Plan, params: dict[str, ParamInfo]) -> list[str]:
    body = []
    for stage, names in zip(plan.stages, stage_params(plan, params)):
        span = stage.modules[0] if len(stage.modules) == 1 else f"{stage.modules[0]} .. {stage.modules[-1]}"
        body.append([str(stage.index), f"{span} ({len(stage.modules)})", f"{human_count(stage.flops)}FLOP",
                     human_count(stage.param_count), human_bytes(stage.activation_bytes),
                     human_bytes(stage.boundary_bytes), human_bytes(param_bytes(plan, params, names)[0])])
    header = ["stage", "modules", "fwd FLOPs/rank", "params", "activations", "sends", "param mem/rank"]
    if len(plan.stages) == 1:
        return [f"Pipeline stages (pp={plan.pp}):", *_table(header, body)]
    imb = plan.imbalance()
    return [f"Pipeline stages (pp={plan.pp}, balanced for {getattr(plan.balance, 'value', plan.balance)}):", *_table(header, body),
            f"imbalance (max/mean): compute {imb['compute']:.3f}, params {imb['params']:.3f}"]


def data_parallel_lines(fullest: float, dp: int, mode: DataParallelMode) -> list[str]:
    """What ``dp`` replicas add per rank and per step, given the fullest rank's parameter bytes (tp x pp).

    fsdp shards parameters and AdamW's two moments over dp, all-gathers parameters before forward and
    backward and reduce-scatters gradients: 3 (dp-1)/dp of them sent per rank over a ring; replicate keeps
    them whole and all-reduces gradients: 2 (dp-1)/dp.
    """
    share = (dp - 1) / dp
    if mode is DataParallelMode.FSDP:
        return [f"  data parallelism (dp={dp}, fsdp): parameters + AdamW moments per rank "
                f"{human_bytes(3 * fullest / dp)} (vs {human_bytes(3 * fullest)} at dp=1); per step 2 all-gathers of "
                f"the parameters and 1 reduce-scatter of the gradients over dp: each rank sends "
                f"{human_bytes(3 * share * fullest)} over a ring"]
    return [f"  data parallelism (dp={dp}, replicate): parameters + AdamW moments per rank {human_bytes(3 * fullest)} "
            f"(whole on every replica); per step 1 all-reduce of the gradients over dp: each rank sends "
            f"{human_bytes(2 * share * fullest)} over a ring"]


def plan_table(plan: Plan, params: dict[str, ParamInfo], batch: int, seq: int, expand: bool = False,
               dp: int = 1, dp_mode: DataParallelMode = DataParallelMode.FSDP) -> str:
    """The plan as text: split modules, collectives per block, stages, totals and notes.

    Rows of identical repeated blocks are merged (``h.[0-11]``) unless ``expand``. With ``dp`` > 1 the totals
    add what the data-parallel replicas hold and send (the plan itself is per tp x pp).
    """
    split = sum(p.is_split for p in plan.placements.values())
    replicas = f", dp={dp} ({dp_mode.value})" if dp > 1 else ""
    replicas += ", sequence parallel" if plan.sequence_parallel else ""
    lines = [f"autotp plan for {plan.model or 'model'}: tp={plan.tp}, pp={plan.pp}{replicas}; "
             f"{split}/{len(plan.placements)} parameters split; costs at batch {batch}, seq {seq}", ""]
    lines += _module_section(plan, params, expand) + [""]
    lines += _collective_section(plan, batch, seq, expand) + [""]
    if plan.stages:
        lines += _stage_section(plan, params) + [""]
    whole = param_bytes(plan, params)[1]
    fullest = per_rank_param_bytes(plan, params)
    payload, wire = step_bytes(plan, batch, seq)
    where = " (fullest stage)" if len(plan.stages) > 1 else ""
    lines += ["Totals:",
              f"  parameter memory per rank: {human_bytes(fullest)}{where} vs {human_bytes(whole)} unsharded "
              f"({whole / fullest if fullest else 1:.2f}x less)",
              f"  communication per training step (forward + backward): {len(step_collectives(plan))} collectives, "
              f"{human_bytes(payload)} of tensors; each rank sends {human_bytes(wire)} over a ring"]
    if dp > 1:
        lines += data_parallel_lines(fullest, dp, dp_mode)
    lines += [f"  note: {n}" for n in plan.notes]
    return "\n".join(lines)
