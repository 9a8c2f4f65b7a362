"""What ``autotp plan``, ``viz`` and ``check`` read from their command line: the model built from its spec, its
example inputs, and its plan (made, searched for a number of devices, or read from ``--plan``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from autotp.errors import InputError
from autotp.options import DataParallelMode, Options

if TYPE_CHECKING:  # torch loads only when a command runs: --help answers at once
    from torch import nn

    from autotp.planning import Plan
    from autotp.tools.report import ParamInfo


@dataclass(frozen=True)
class Planned:
    """A model, the example it was captured with, its plan and its parameter shapes."""

    model: nn.Module
    inputs: tuple
    plan: Plan
    params: dict[str, ParamInfo]


def load_plan_file(path: str, params: dict[str, ParamInfo], tp: int | None) -> Plan:
    """The plan in the file ``path``, checked against the model's parameters ``params`` and ``tp``."""
    from autotp.planning import Plan, check_plan_fits

    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise InputError(f"cannot read the plan file {path}: {e.strerror}") from e
    shapes = {name: info.shape for name, info in params.items()}
    return check_plan_fits(Plan.from_json(text), shapes, tp=tp, source=f"the plan in {path}")


def load_and_plan(args) -> Planned:
    """Build MODEL, make its example inputs, and plan it (or read ``--plan``)."""
    import autotp
    from autotp.tools.model_spec import (
        build_model,
        example_inputs,
        parse_overrides,
        parse_spec,
    )
    from autotp.tools.report import param_infos

    spec = parse_spec(args.model, parse_overrides(args.overrides))
    devices = getattr(args, "devices", None)
    if args.tp is None and not args.plan_file and devices is None and (getattr(args, "cp", None) or 1) == 1:
        raise InputError("--tp is required (the number of tensor-parallel ranks), e.g. --tp 2, or --devices N to "
                         "let the planner choose the layout")
    if args.plan_file and devices is not None:
        raise InputError("--devices lets the planner choose the layout, and --plan gives one: pass one of them")
    model = build_model(spec)
    inputs = example_inputs(model, args.vocab_size)
    params = param_infos(model)
    if args.plan_file:
        return Planned(model, inputs, load_plan_file(args.plan_file, params, args.tp), params)
    if devices is not None:
        return Planned(model, inputs, autotp.plan(model, example_inputs=inputs, world_size=devices,
                                                  machine=args.machine, **searched_settings(args)), params)
    return Planned(model, inputs, autotp.plan(model, example_inputs=inputs, options=options_of(args)), params)


def searched_settings(args) -> dict:
    """The settings of ``autotp plan --devices``: the layout flags given (``--ep`` too) are fixed (the rest
    searched)."""
    budget = args.device_memory or args.memory_budget
    return {"tp": args.tp, "pp": args.pp, "dp": args.dp, "cp": getattr(args, "cp", None),
            "ep": getattr(args, "ep", None), "dp_mode": args.dp_mode, "balance": args.balance,
            "batch": args.batch, "seq": args.seq, "vocab": args.vocab, "memory_budget": budget,
            "sequence_parallel": True if args.sequence_parallel else None}


def options_of(args, plan: Plan | None = None) -> Options:
    """The settings the command line gives, as the one options value the library takes (with ``--plan``, the
    plan's tp)."""
    tp = args.tp or (plan.tp if plan is not None else None)
    return Options.build(tp=tp, pp=args.pp, ep=getattr(args, "ep", None), cp=getattr(args, "cp", None),
                         cp_exchange=getattr(args, "cp_exchange", None), balance=args.balance, batch=args.batch, seq=args.seq,
                         vocab=args.vocab, memory_budget=args.memory_budget,
                         sequence_parallel=args.sequence_parallel, recompute=args.recompute,
                         schedule=getattr(args, "schedule", None),
                         mixed_precision=getattr(args, "mixed_precision", None))


def plan_text(planned: Planned, args) -> str:
    """The table ``autotp plan`` prints: the plan's, or with ``--devices`` the ranked layouts."""
    from autotp.tools.report import plan_table

    if getattr(args, "devices", None) is not None:
        from autotp.tools.layout_table import layout_table

        return layout_table(planned.plan, args.devices, args.machine or "this machine")
    return plan_table(planned.plan, planned.params, args.batch, args.seq, expand=args.expand,
                      dp=getattr(args, "dp", None) or 1, dp_mode=DataParallelMode(getattr(args, "dp_mode", None) or "fsdp"))
