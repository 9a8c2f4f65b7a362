"""The zoo: every transformer a user might bring, planned and checked in one process, as a coverage table.
A repository tool (``devtools/`` is not installed with autotp): run it from the repository root.

    autotp zoo                          # every type, tp=2 and tp=4, writes docs/COVERAGE.md
    autotp zoo --only llama,gpt2 -o -   # some types, the table on stdout
    python -m devtools.zoo --only gpt2  # the same, without the autotp command

Entries: every model type of the installed transformers' causal-LM mapping (a tiny config of each,
random weights), encoders (BERT family), encoder-decoders (fed ``decoder_input_ids``), torch's own
``nn.TransformerEncoder``/``nn.Transformer``, the repository's examples, and any ``file.py:factory``.
Each runs through ``autotp.check`` (every rank simulated, one training step compared with the model).
"""

from __future__ import annotations

import copy
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import fx, nn

from autotp.capture import model_kwargs
from autotp.capture.core.examples import example_inputs_of, vocab_size
from autotp.checker import check_prepared, prepare
from autotp.errors import AutotpError, TrainingSettingError
from autotp.names import within
from autotp.passes.choices import whole_convolutions
from devtools.zoo_diffusers import diffusers_entries
from devtools.zoo_entries import (
    Entry,
    build_reason,
    error_line,
    example_entries,
    hf_entries,
    timm_entries,
    torch_entries,
)
from devtools.zoo_results import Result, Status

SIZEABLE = 4096
"""A matrix (or a bank of expert matrices) of at least this many elements (64 x 64 in the tiny configs)
should be split."""


def entries(only: set[str] | None = None, extra: tuple[str, ...] = (), families: set[str] | None = None,
            at_full_context: bool = False) -> list[Entry]:
    """Every zoo entry (or those named in ``only``, or of the ``families`` given), plus ``file.py:factory``
    specs in ``extra``; ``at_full_context``: transformers models with position tables as long as the example."""
    out = hf_entries(at_full_context) + diffusers_entries() + timm_entries() + torch_entries() + example_entries(extra)
    return [e for e in out if (only is None or e.name in only) and (families is None or e.family in families)]


def run_entry(entry: Entry, tp: int, limit_s: int = 240, sequence_parallel: bool = False) -> Result:
    """Build, plan and check one entry at ``tp`` (at most ``limit_s`` seconds), with sequence parallelism if asked."""
    return run_entry_at(entry, (tp,), limit_s, sequence_parallel)[tp]


def run_entry_at(entry: Entry, tps: tuple[int, ...], limit_s: int = 240,
                 sequence_parallel: bool = False) -> dict[int, Result]:
    """Build and capture one entry once, then plan and check it at each of ``tps`` (at most ``limit_s`` seconds
    each; the first tp's time and limit include the capture, which is most of a small model's check)."""
    start = time.perf_counter()
    try:
        torch.manual_seed(0)
        model = entry.build()
        inputs = entry.inputs(model)
        with torch.no_grad():  # the model must run its own forward on these inputs
            example_inputs_of(model, inputs).call(model, model_kwargs(model))
    except Exception as e:  # any failure to build or run is the entry's, not autotp's
        failed = Result(Status.NOT_BUILDABLE, notes=[build_reason(e)], seconds=time.perf_counter() - start)
        return dict.fromkeys(tps, failed)
    start = time.perf_counter()
    prepared, model, note = _prepared(model, inputs, limit_s, start)
    if isinstance(prepared, Result):
        return dict.fromkeys(tps, _noted(prepared, note))
    out = {}
    excused = input_convolutions(prepared.captured) | added_tables(prepared.captured)
    for tp in tps:
        def run(tp=tp):
            # coverage: can it split, exactly
            report = check_prepared(prepared, tp, vocab="split", sequence_parallel=sequence_parallel)
            return report, {name: p.numel() for name, p in model.named_parameters() if name in report.read}
        outcome = _outcome(run, limit_s, start)
        out[tp] = _noted(outcome if isinstance(outcome, Result) else
                         _verdict(*outcome, model, time.perf_counter() - start, excused), note)
        start = time.perf_counter()
    return out


def _prepared(model: nn.Module, inputs, limit_s: int, start: float) -> tuple:
    """``prepare(model, inputs)`` (or the ``Result`` that says how it failed), the model prepared, and a note. A
    capture refused naming the config settings that switch training-time randomness off (SpecAugment's
    ``mask_time_prob``, LayerDrop's ``layerdrop``) is prepared again from the model rebuilt with them: the table
    records that check, and the note says the default config was refused and which settings were checked."""
    applied: dict[str, object] = {}
    first = None
    while True:
        refusal = []

        def step(model=model):
            try:
                return prepare(model, inputs)
            except TrainingSettingError as e:
                refusal.append(e)
                raise

        outcome = _outcome(step, limit_s, start)
        if not refusal or set(refusal[0].settings) <= set(applied) or getattr(model, "config", None) is None:
            break
        first = first or error_line(refusal[0])
        applied |= refusal[0].settings
        model = _with_settings(model, applied)
    settings = ", ".join(f"{k}={v}" for k, v in applied.items())
    return outcome, model, f"refused with the default config ({first}); checked with {settings}" if applied else None


def _with_settings(model: nn.Module, settings: dict) -> nn.Module:
    """A fresh model of ``model``'s class from a copy of its config with ``settings`` set (the same seed the
    zoo builds with)."""
    config = copy.deepcopy(model.config)
    for path, value in settings.items():  # a setting of a nested config is named by its path: encoder.layerdrop
        *parts, name = path.split(".")
        owner = config
        for part in parts:
            owner = getattr(owner, part)
        setattr(owner, name, value)
    torch.manual_seed(0)
    rebuilt = type(model)(config)
    rebuilt.train(model.training)
    return rebuilt


def _noted(result: Result, note: str | None) -> Result:
    """``result`` with ``note`` first among its notes."""
    if note:
        result.notes.insert(0, note)
    return result


def _outcome(step: Callable, limit_s: int, start: float):
    """``step()``'s value, or the ``Result`` that says how it failed (timed from ``start``)."""
    try:
        with _TimeLimit(limit_s):
            return step()
    except AutotpError as e:
        status = Status.CRASH if type(e).__name__ == "InternalError" else Status.REFUSED
        return Result(status, notes=[error_line(e)], seconds=time.perf_counter() - start)
    except TimeoutError as e:
        return Result(Status.TIMEOUT, notes=[error_line(e)], seconds=time.perf_counter() - start)
    except Exception as e:  # a raw error out of autotp is a bug: report it as one
        return Result(Status.CRASH, notes=[error_line(e)], seconds=time.perf_counter() - start)


def input_convolutions(captured) -> set[str]:
    """The weights of dense convolutions over the model's inputs (a patch embedding, a stem, an audio front end):
    what they read depends on no parameter. The first layer, on raw pixels or samples: Megatron's vision
    models keep it whole too, and the layers after it split."""
    params = set(captured.param_names)
    # One pass in graph order (inputs before users): a node reads parameters if it is one or any input does. No
    # walk back per convolution, and no recursion as deep as the model.
    reads: set[fx.Node] = set()
    for node in captured.graph.nodes:
        if (node.op == "get_attr" and captured.aliases.get(captured.param_name(node.target)) in params) or \
                any(n in reads for n in node.all_input_nodes):
            reads.add(node)
    return {captured.aliases.get(captured.param_name(target), "")
            for node, target in whole_convolutions(captured.graph, set()) if node.args[0] not in reads}


_JOINS = {"add", "sub", "cat", "stack"}
"""Ops that join a tensor to the activations as they are (a position table added, a class token put before the
patches): what reaches only these is a table, not a matrix the forward multiplies by."""


def added_tables(captured) -> set[str]:
    """The parameters that are only joined to activations (``_JOINS``), after ops on themselves alone (a slice, a
    reshape, an interpolation to the input's size): position tables and class tokens kept as parameters, which
    Megatron keeps whole as it keeps position embeddings."""
    def joined_only(node: fx.Node) -> bool:
        uses = list(node.users)
        if not uses:
            return True
        for use in uses:
            target = str(use.target)
            op = target.split(".")[1] if target.startswith("aten.") else getattr(use.target, "__name__", "")
            if op in _JOINS:
                continue
            tensors = [n for n in use.all_input_nodes if not isinstance(n.meta.get("val"), (int, torch.SymInt))]
            if tensors == [node] and use.op == "call_function" and joined_only(use):
                continue  # an op on this tensor alone (a view, a cast, an interpolation): follow it
            return False
        return True

    return {captured.aliases.get(captured.param_name(n.target), "") for n in captured.graph.find_nodes(op="get_attr")
            if n.users and joined_only(n)}


def _verdict(report, used: dict[str, int], model: nn.Module, seconds: float,
             excused: set[str] = frozenset()) -> Result:
    if not report.exact:
        return Result(Status.MISMATCH, notes=[str(report.mismatch)], seconds=seconds)
    split = {n for n, p in report.plan.placements.items() if p.is_split}
    total = sum(used.values()) or 1
    fraction = sum(n for name, n in used.items() if name in split) / total
    shapes = dict(model.named_parameters())
    tables = _side_tables(model, report.plan)
    chosen = {name for name in used if any(within(name, layer) for layer in report.plan.by_choice)}
    whole = [name for name, n in used.items()
             if name not in split | tables | chosen | excused and n >= SIZEABLE and shapes[name].dim() >= 2]
    notes = list(report.plan.notes)
    if report.rounding:
        notes.insert(0, f"exact in float64; float32 differs by rounding amplified by the model ({report.rounding})")
    if whole:
        notes.insert(0, f"kept whole: {', '.join(whole[:4])}{' ...' if len(whole) > 4 else ''}")
    return Result(Status.PARTIAL if whole else Status.EXACT, fraction, notes, seconds)


def _side_tables(model: nn.Module, plan) -> set[str]:
    """Embedding tables not indexed by the vocabulary (positions, token types): Megatron keeps them whole too.
    Where the plan split the vocabulary, every other table; else those of another size than the vocabulary."""
    tables = {f"{name}.weight" if name else "weight" for name, m in model.named_modules() if isinstance(m, nn.Embedding)}
    vocab_split = {name for name, p in plan.placements.items() if p.kind.value == "vocab"}
    if vocab_split:
        return tables - vocab_split
    try:
        vocab = vocab_size(model)
    except AutotpError:
        vocab = None
    return {t for t in tables if model.get_submodule(t.rpartition(".")[0]).num_embeddings != vocab}


WALL_FACTOR = 4
"""A limit by the clock this many times the CPU-time limit: a model that hangs waiting uses no CPU time."""


class _TimeLimit:
    """Raise ``TimeoutError`` in the main thread after ``seconds`` of this process's CPU time, or ``WALL_FACTOR``
    times as long by the clock (a model that hangs must not stop the sweep). CPU time, so that a sweep sharing
    its machine (a test suite beside it made entries 10-25 times slower by the clock) times out the same entries
    as one alone."""

    TIMERS = ((signal.ITIMER_PROF, signal.SIGPROF, 1), (signal.ITIMER_REAL, signal.SIGALRM, WALL_FACTOR))

    def __init__(self, seconds: float):
        self.seconds = seconds

    def __enter__(self):
        def expire(signum, _frame):
            clock = "by the clock" if signum == signal.SIGALRM else "of CPU time"
            scale = WALL_FACTOR if signum == signal.SIGALRM else 1
            raise TimeoutError(f"took more than {self.seconds * scale} s {clock}")
        self.previous = {sig: signal.signal(sig, expire) for _, sig, _ in self.TIMERS}
        for timer, _, scale in self.TIMERS:
            # then again every 5 s: code that catches every exception (a fallback path) may swallow the first
            signal.setitimer(timer, self.seconds * scale, 5)

    def __exit__(self, *exc):
        for timer, sig, _ in self.TIMERS:
            signal.setitimer(timer, 0)
            signal.signal(sig, self.previous[sig])
        return False


def sweep(chosen: list[Entry], tps=(2, 4), progress=sys.stderr, sequence_parallel: bool = False,
          on_result: Callable[[str, dict[int, Result]], None] | None = None) -> dict[str, dict[int, Result]]:
    """Every entry at every tp, printing one progress line per run; ``on_result(name, runs)`` after each
    entry (to save as it goes: a long sweep stopped early keeps what it did)."""
    out: dict[str, dict[int, Result]] = {}
    for i, entry in enumerate(chosen, 1):
        out[entry.name] = run_entry_at(entry, tuple(tps), sequence_parallel=sequence_parallel)
        for tp, result in out[entry.name].items():
            print(f"[{i}/{len(chosen)}] {entry.name} tp={tp}: {result.status.value} ({result.seconds:.1f} s)",
                  file=progress, flush=True)
        if on_result is not None:
            on_result(entry.name, out[entry.name])
    return out


def _round_robin(chosen: list[Entry]) -> list[Entry]:
    """The entries one group after another in turn (the first of each group, then the second ...)."""
    groups: dict[str, list[Entry]] = {}
    for entry in chosen:
        groups.setdefault(entry.family, []).append(entry)
    longest = max((len(g) for g in groups.values()), default=0)
    return [g[i] for i in range(longest) for g in groups.values() if i < len(g)]


def main(argv: list[str]) -> int:
    """``autotp zoo [--only a,b] [--family f,g] [--tp 2 4] [-o FILE] [--save F.json] [--load F.json ...]``."""
    import argparse

    from devtools.zoo_table import coverage_table, load_results, save_results

    parser = argparse.ArgumentParser(prog="autotp zoo", description="check every model type, write the coverage table")
    parser.add_argument("--only", help="comma-separated entry names (default: all)")
    parser.add_argument("--family", help="comma-separated task groups (causal-lm, masked-lm, ..., torch, example)")
    parser.add_argument("--tp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--file", action="append", default=[], metavar="FILE.py:FACTORY", help="extra models")
    parser.add_argument("-o", "--output", default="docs/COVERAGE.md", help="the table (- for stdout)")
    parser.add_argument("--save", metavar="FILE.json", help="also save the results, to merge sweeps later")
    parser.add_argument("--load", nargs="+", default=[], metavar="FILE.json",
                        help="write the table from saved results instead of sweeping (later files win)")
    parser.add_argument("--pending", action="store_true",
                        help="with --load: list every entry the saved sweeps lack as pending")
    parser.add_argument("--note", default="", help="a paragraph under the table's introduction (which sweep, when)")
    parser.add_argument("--sequence-parallel", action="store_true", help="check with sequence_parallel=True")
    parser.add_argument("--full-context", action="store_true",
                        help="build transformers models with position tables and mask buffers as long as the example's "
                             "sequence (max_position_embeddings and the like set to it)")
    parser.add_argument("--shard", default="", metavar="I/N", help="every N-th entry from the I-th (parallel sweeps)")
    parser.add_argument("--resume", action="store_true", help="skip the entries already in the --save file")
    parser.add_argument("--ep", type=int, help="check the mixtures of experts at tp=ep=EP instead, and write their "
                                               "column of the coverage page (devtools.zoo_ep)")
    args = parser.parse_args(argv)
    if args.ep:
        return _ep_main(args)
    if args.load:
        results, families = load_results(args.load)
        if args.pending:  # a sweep stopped early: list the entries it did not reach, so that every type has a row
            for entry in entries():
                if entry.name not in results:
                    results[entry.name] = dict.fromkeys(args.tp, Result(Status.PENDING))
                    families[entry.name] = entry.family
    else:
        chosen = entries(set(args.only.split(",")) if args.only else None, tuple(args.file),
                         set(args.family.split(",")) if args.family else None, args.full_context)
        chosen = _round_robin(chosen)  # a sweep stopped early has checked some of every group
        first, _, count = args.shard.partition("/")
        chosen = chosen[int(first)::int(count)] if count else chosen
        resuming = args.save and args.resume and Path(args.save).exists()
        done, families = load_results([args.save]) if resuming else ({}, {})
        families |= {e.name: e.family for e in chosen}
        chosen = [e for e in chosen if e.name not in done]
        torch.set_num_threads(max(1, torch.get_num_threads()))

        def save(name, runs):
            done[name] = runs
            save_results(args.save, done, families)

        results = done | sweep(chosen, tuple(args.tp), sequence_parallel=args.sequence_parallel,
                               on_result=save if args.save else None)
    table = coverage_table(results, families, tuple(args.tp), args.sequence_parallel, args.note)
    if args.output == "-":
        print(table)
    else:
        with open(args.output, "w", encoding="utf-8") as f:
            f.write(table)
        print(f"wrote {args.output}", file=sys.stderr)
    return 0


def _ep_main(args) -> int:
    """``autotp zoo --ep N``: the mixture-of-experts entries at tp=ep=N, written into the coverage page's ep
    section (or printed with ``-o -``)."""
    from devtools.zoo_ep import ep_section, load, run, save, with_section

    if args.load:
        results = load(args.load)
    else:
        chosen = entries(set(args.only.split(",")) if args.only else None, tuple(args.file),
                         set(args.family.split(",")) if args.family else None, args.full_context)
        seen: set[str] = set()  # one entry per model type: the first group's (causal LM)
        chosen = [e for e in chosen if (kind := e.name.split(":")[0]) not in seen and not seen.add(kind)]
        first, _, count = args.shard.partition("/")
        chosen = chosen[int(first)::int(count)] if count else chosen
        results = run(chosen, args.ep, _prepared, _outcome,
                      on_result=(lambda done: save(args.save, done)) if args.save else None)
    section = ep_section(results, args.ep, args.note)
    if args.output == "-":
        print(section)
        return 0
    page = Path(args.output).read_text(encoding="utf-8") if Path(args.output).exists() else ""
    Path(args.output).write_text(with_section(page, section), encoding="utf-8")
    print(f"wrote the ep={args.ep} section of {args.output}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
