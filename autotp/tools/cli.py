"""The ``autotp`` command: read a plan (``plan``), look at it (``viz``), check it is exact in one process
(``check``), and run the benchmarks (``bench``).

    autotp plan examples/gpt.py:build_gpt --tp 2                  # the table
    autotp plan hf:llama --tp 2 --format json -o plan.json        # the plan file
    autotp viz examples/gpt.py:build_gpt --tp 2 -o plan.svg       # the picture
    autotp viz hf:llama --tp 2 --pp 2 --schedule 1f1b -o tl.png   # the pipeline timeline
    autotp check hf:gpt2 --tp 2                                   # every rank simulated, compared
    autotp plan hf:llama --devices 64 --machine h100              # the layouts the planner ranks

Anything the user can fix (a bad MODEL, an unknown format, tp that does not fit) is one line on
stderr and exit code 2; an internal error (a bug in autotp) prints its traceback and exits 1.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import traceback
import warnings
from enum import Enum
from pathlib import Path

from autotp.errors import AutotpError, InputError, InternalError
from autotp.mixed_precision import DTYPES
from autotp.options import Balance, ContextExchange, DataParallelMode, Recompute, Schedule, VocabChoice
from autotp.tools.generate_cli import add_parser as add_generate_parser
from autotp.tools.planned import load_and_plan, load_plan_file, options_of, plan_text

MACHINE_NAMES = ("cpu", "h100", "h200", "a100")
"""``autotp.planning.machines.MACHINES``' names (written out so that --help loads no torch; a test checks them)."""

EXIT_USAGE = 2
EXIT_BUG = 1
EXIT_MISMATCH = 1


class UsageError(Exception):
    """A bad command line (argparse's complaint), reported in one line."""


class TextFormat(str, Enum):
    """What ``autotp plan`` prints."""

    TABLE = "table"
    """Split modules, collectives per block, stages and totals, for people."""
    JSON = "json"
    """The plan file (``Plan.to_json``), loadable with ``autotp.Plan.from_json``."""
    HF = "hf"
    """A Hugging Face ``tp_plan`` dict as JSON (modules HF cannot express are left out, with a note)."""
    TORCH = "torch"
    """Python source of a torch ``parallelize_module`` plan."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse prints usage and exits; we want one line and our exit code
        raise UsageError(f"{message} (see `{self.prog} --help`)")


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", metavar="MODEL",
                   help="path/to/file.py:factory, package.module:factory, hf:<model_type> or hf:path/to/config.json")
    p.add_argument("--tp", type=_positive, help="tensor-parallel ranks (default: the --plan file's, else required)")
    p.add_argument("--pp", type=_positive, help="pipeline stages (default 1; with --devices, searched)")
    p.add_argument("--ep", type=_positive,
                   help="expert-parallel ranks among which the routed experts are divided, taken from the data- and "
                        "tensor-parallel ranks (default 1; docs/expert-parallelism.md)")
    p.add_argument("--cp", type=_positive, help="context-parallel ranks: every sequence split across them for the "
                                                "whole model, attention exchanging keys and values (default 1)")
    p.add_argument("--cp-exchange", choices=[c.value for c in ContextExchange],
                   help="how attention exchanges keys and values across the cp ranks: all_gather, ring, ulysses, or "
                        "auto, the cost model's choice per attention (default auto)")
    p.add_argument("--batch", type=_positive, default=8, help="batch size to cost the plan at (default 8)")
    p.add_argument("--seq", type=_positive, default=32, help="sequence length to cost the plan at (default 32)")
    p.add_argument("--balance", choices=[b.value for b in Balance], default=Balance.BOTH.value,
                   help="what the stage split balances (default both)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="NAME=VALUE",
                   help="factory keyword argument or HF config field; repeatable")
    p.add_argument("--vocab-size", type=_positive, help="vocabulary of the example token ids (default: the model's)")
    p.add_argument("--vocab", choices=[c.value for c in VocabChoice], default=VocabChoice.AUTO.value,
                   help="split the embedding and LM head along the vocabulary: auto (where the cost model finds it "
                        "faster at --batch/--seq, or needed to fit --memory-budget; default), split or whole")
    p.add_argument("--memory-budget", metavar="BYTES", help="bytes per rank for training state, e.g. 40GiB")
    p.add_argument("--sequence-parallel", action="store_true",
                   help="split the residual stream between regions along the sequence (Megatron's sequence parallelism)")
    p.add_argument("--recompute", choices=[r.value for r in Recompute],
                   help="recompute each block's activations in backward instead of keeping them (default none)")
    p.add_argument("--mixed-precision", choices=list(DTYPES), metavar="DTYPE",
                   help="compute in this dtype under autocast over fp32 weights (autotp.MixedPrecision's "
                        f"compute_dtype: {', '.join(DTYPES)}); recorded in the plan")
    p.add_argument("--plan", dest="plan_file", metavar="FILE", help="read this plan (JSON) instead of planning")
    p.add_argument("--expand", action="store_true", help="list every repeated block instead of collapsing them")


def _run_generate(args) -> int:
    from autotp.tools.generate_cli import run_generate

    return run_generate(args)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``autotp`` (errors raise ``UsageError`` instead of exiting)."""
    parser = _Parser(prog="autotp", description="Read, draw and benchmark autotp's tensor/pipeline-parallel plans; "
                                                "generate with them.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    plan = sub.add_parser("plan", help="print the plan as a table, JSON, or an HF/torch plan")
    _common(plan)
    plan.add_argument("--format", choices=[f.value for f in TextFormat],
                      help="what to print (default: json for -o *.json, torch for -o *.py, else table)")
    plan.add_argument("-o", "--output", metavar="FILE", help="write to FILE instead of stdout")
    plan.add_argument("--dp", type=_positive,
                      help="data-parallel replicas: the table adds their memory per rank and gradient collectives "
                           "(default 1; with --devices, searched)")
    plan.add_argument("--dp-mode", choices=[m.value for m in DataParallelMode],
                      help="how the replicas hold the model (default fsdp; with --devices, searched)")
    plan.add_argument("--devices", type=_positive, metavar="N",
                      help="let the planner choose the layout of N devices (tp, pp, dp, schedule, microbatches, "
                           "sequence parallelism; any of them given is kept) and print the ranked layouts")
    plan.add_argument("--machine", choices=sorted(MACHINE_NAMES),
                      help="the machine --devices are priced on: " + ", ".join(sorted(MACHINE_NAMES))
                           + " (default: this one)")
    plan.add_argument("--device-memory", metavar="BYTES",
                      help="memory per device for --devices, e.g. 80GiB (default: the machine's; same as "
                           "--memory-budget)")
    plan.add_argument("--schedule", choices=[c.value for c in Schedule],
                      help="pipeline schedule the plan is for (zbv and dualpipev: two stages per rank in a V; with "
                           "--devices, searched)")
    viz = sub.add_parser("viz", help="draw the plan (svg, png, html, dot) or its pipeline timeline")
    _common(viz)
    viz.add_argument("-o", "--output", metavar="FILE", required=True, help="plan.svg, plan.png, plan.html or plan.dot")
    viz.add_argument("--format", metavar="{svg,png,html,dot}", help="picture format (default: from -o's suffix)")
    viz.add_argument("--schedule", choices=[Schedule.GPIPE.value, Schedule.ONE_F_ONE_B.value], help="draw this pipeline schedule's timeline instead")
    viz.add_argument("--microbatches", type=_positive,
                     help="microbatches in the timeline (default: 2 x stages, at least 4)")
    check = sub.add_parser("check", help="simulate every rank in this process and compare one training step with "
                                         "the unsharded model (exit 0 exact, 1 mismatch)")
    _common(check)
    add_generate_parser(sub)
    sub.add_parser("zoo", help="check every transformers model type (and more); writes docs/COVERAGE.md. A "
                               "repository tool (devtools/, not installed): run it from an autotp checkout's root",
                   add_help=False)
    sub.add_parser("bench", help="run the benchmarks (arguments pass through). A repository tool (bench/, not "
                                 "installed): run it from an autotp checkout's root", add_help=False)
    return parser


def run_check(args) -> int:
    """``autotp check``: the one-process checker; prints one line (or the mismatch and where it starts)."""
    import autotp
    from autotp.tools.model_spec import (
        build_model,
        example_inputs,
        parse_overrides,
        parse_spec,
    )
    from autotp.tools.report import param_infos

    spec = parse_spec(args.model, parse_overrides(args.overrides))
    if args.tp is None and not args.plan_file and (getattr(args, "cp", None) or 1) == 1:
        raise InputError("--tp is required (the number of tensor-parallel ranks), e.g. --tp 2")
    model = build_model(spec, weights=True)
    inputs = example_inputs(model, args.vocab_size)
    plan = load_plan_file(args.plan_file, param_infos(model), args.tp) if args.plan_file else None
    report = autotp.check(model, args.tp or plan.tp, inputs, plan=plan, options=options_of(args, plan))
    print(report)
    return 0 if report.exact else EXIT_MISMATCH


def _emit(text: str, output: str | None) -> None:
    if output:
        Path(output).write_text(text if text.endswith("\n") else text + "\n", encoding="utf-8")
    else:
        print(text)


def _text_format(chosen: str | None, output: str | None) -> TextFormat:
    """The format asked for, else the one the output file's suffix names (a plan.json gets the plan file)."""
    if chosen:
        return TextFormat(chosen)
    suffix = Path(output).suffix.lower() if output else ""
    return {".json": TextFormat.JSON, ".py": TextFormat.TORCH}.get(suffix, TextFormat.TABLE)


def run_plan(args) -> int:
    """``autotp plan``: print or write the table, the plan JSON, or an HF/torch plan."""
    from autotp.tools.exports import (
        Target,
        export_styles,
        to_hf_tp_plan,
        torch_plan_source,
    )

    planned = load_and_plan(args)
    plan, fmt = planned.plan, _text_format(args.format, args.output)
    if fmt is TextFormat.JSON:
        text = plan.to_json()
    elif fmt is TextFormat.HF:
        text = json.dumps(to_hf_tp_plan(plan, strict=False), indent=2)
        skipped = export_styles(plan, Target.HF).skipped
        if skipped:
            print(f"autotp: note: {len(skipped)} module(s) left replicated in the HF plan, e.g. "
                  f"{next(iter(skipped))}: {next(iter(skipped.values()))}", file=sys.stderr)
    elif fmt is TextFormat.TORCH:
        text = torch_plan_source(plan)
    else:
        text = plan_text(planned, args)
    _emit(text, args.output)
    if args.output:  # on stderr: stdout stays what was asked for
        print(f"autotp: wrote {args.output}: {_WRITTEN[fmt]} (tp={plan.tp}, pp={plan.pp})", file=sys.stderr)
    return 0


_WRITTEN = {TextFormat.TABLE: "the plan table", TextFormat.JSON: "the plan file; autotp.Plan.from_json or --plan "
            "reads it", TextFormat.HF: "a Hugging Face tp_plan", TextFormat.TORCH: "a torch parallelize_module plan"}


def _run_viz(args) -> int:
    from autotp.tools.viz_cli import run_viz

    return run_viz(args)


REPOSITORY_TOOLS = {"bench": ("bench", "bench/"), "zoo": ("devtools.zoo", "devtools/zoo.py")}
"""The commands that run a tool of the repository, not of the installed package: its module and where it lives."""


def repository_tool(command: str):
    """The module ``autotp COMMAND`` runs, imported from the current directory (an autotp checkout's root): these
    tools are not installed with the package, so anywhere else this is an ``InputError`` that says so."""
    module, where = REPOSITORY_TOOLS[command]
    if str(Path.cwd()) not in sys.path and "" not in sys.path:
        sys.path.insert(0, str(Path.cwd()))
    try:
        return importlib.import_module(module)
    except ImportError as e:
        missing = e.name is not None and module.startswith(e.name)
        why = "it is not here" if missing else f"it cannot be imported here ({e})"
        raise InputError(f"autotp {command} is a repository tool: it runs {where} of an autotp checkout, which is "
                         f"not installed with the package, and {why}; run it from the repository root "
                         f"(git clone the autotp repository, cd into it, then autotp {command} ...)") from e


def run_repository_tool(command: str, argv: list[str]) -> int:
    """``autotp bench ARGS`` or ``autotp zoo ARGS``: the repository tool's own ``main(argv)``."""
    tool = repository_tool(command)
    if not callable(getattr(tool, "main", None)):
        raise InputError(f"{REPOSITORY_TOOLS[command][1]} has no main(argv) function; update the repository")
    result = tool.main(argv)
    return result if isinstance(result, int) else 0


def _fail(message: str) -> int:
    print(f"autotp: error: {' '.join(str(message).split())}", file=sys.stderr)
    return EXIT_USAGE


def main(argv: list[str] | None = None) -> int:
    """Run the command line ``argv`` (default ``sys.argv[1:]``); returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] in (["bench"], ["zoo"]):  # everything after the command belongs to the tool's own parser
        try:
            return run_repository_tool(argv[0], argv[1:])
        except AutotpError as e:
            return _fail(str(e))
    try:
        args = build_parser().parse_args(argv)
    except UsageError as e:
        return _fail(str(e))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # library warnings would bury the one line that matters
            return {"plan": run_plan, "viz": _run_viz, "check": run_check,
                    "generate": _run_generate}[args.command](args)
    except InternalError as e:  # not the user's mistake: say so, and keep the traceback for the report
        traceback.print_exc(file=sys.stderr)
        print(f"autotp: {e}", file=sys.stderr)
        return EXIT_BUG
    except AutotpError as e:
        return _fail(str(e))
    except BrokenPipeError:  # `autotp plan ... | head`: the reader left; stop quietly, as other tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except OSError as e:  # writing the output: a missing folder, no permission
        return _fail(f"cannot write {getattr(e, 'filename', '') or 'the output'}: {e.strerror or e}")


if __name__ == "__main__":
    sys.exit(main())
