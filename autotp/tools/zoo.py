"""The zoo: every transformer a user might bring, planned and checked in one process, as a coverage table.

    autotp zoo                          # every type, tp=2 and tp=4, writes docs/COVERAGE.md
    autotp zoo --only llama,gpt2 -o -   # some types, the table on stdout

Entries: every model type of the installed transformers' causal-LM mapping (a tiny config of each,
random weights), encoders (BERT family), encoder-decoders (fed ``decoder_input_ids``), torch's own
``nn.TransformerEncoder``/``nn.Transformer``, the repository's examples, and any ``file.py:factory``.
Each runs through ``autotp.check`` (every rank simulated, one training step compared with the model).
"""

from __future__ import annotations

import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum

import torch
from torch import nn

from autotp.capture import model_kwargs
from autotp.capture.examples import EXAMPLE_BATCH, EXAMPLE_SEQ, synthesise, vocab_size
from autotp.checker import check
from autotp.errors import AutotpError
from autotp.names import within
from autotp.tools.model_spec import build_model, parse_spec

TINY_MOE = {"num_local_experts": 4, "num_experts": 4, "n_routed_experts": 4, "num_experts_per_tok": 2,
            "num_experts_per_token": 2,
            "moe_intermediate_size": 64, "n_shared_experts": 1, "num_shared_experts": 1}
"""Mixture-of-experts fields of a tiny config (4 experts, top-2), set where the architecture has them."""

ENCODERS = ("bert", "roberta", "distilbert", "albert", "electra", "xlm-roberta")
ENCODER_DECODERS = ("t5", "bart")
SIZEABLE = 4096
"""A matrix (or a bank of expert matrices) of at least this many elements (64 x 64 in the tiny configs)
should be split."""


class Status(str, Enum):
    """The verdict of one entry at one tp."""

    EXACT = "exact"
    """Exact, and every sizeable matrix the forward uses is split."""
    PARTIAL = "partial"
    """Exact, something sizeable kept whole (the notes say what and why)."""
    REFUSED = "refused"
    """A clear autotp error (capture or plan), not a wrong answer."""
    NOT_BUILDABLE = "not buildable"
    """The tiny config or its model cannot be built."""
    MISMATCH = "MISMATCH"
    """The checker found a difference: a bug in autotp."""
    CRASH = "CRASH"
    """Something raised that is not an autotp error: a bug in autotp."""


@dataclass(frozen=True)
class Entry:
    """One model of the zoo: how to build it and what to feed it."""

    name: str
    family: str
    build: Callable[[], nn.Module]
    inputs: Callable[[nn.Module], tuple]


@dataclass
class Result:
    """One entry at one tp."""

    status: Status
    split: float | None = None
    """Fraction of the parameters the forward uses that are split."""
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0


def _token_ids(model: nn.Module) -> tuple:
    return synthesise(model).flat  # the ids autotp.plan synthesises when given none


def _encoder_decoder_inputs(model: nn.Module) -> tuple:
    (ids,) = _token_ids(model)
    return ids, torch.ones_like(ids), ids[:, : EXAMPLE_SEQ // 2]


MAX_PARAMS = 20_000_000
"""A tiny config must stay tiny: an architecture whose sizes hide under other field names is not built."""


def _hf_entry(model_type: str, family: str, inputs=_token_ids, seq2seq: bool = False) -> Entry:
    def build():
        import transformers

        from autotp.tools.model_spec import hf_config

        spec = parse_spec(f"hf:{model_type}")
        fields = transformers.AutoConfig.for_model(model_type).to_dict()
        tiny = spec.__class__(spec.kind, spec.target, "", tuple((k, v) for k, v in TINY_MOE.items() if k in fields))
        count = sum(p.numel() for p in build_model(tiny).parameters())  # on the meta device: no memory
        if count > MAX_PARAMS:
            raise ValueError(f"the small config still has {count / 1e6:.0f}M parameters (its sizes have other "
                             "field names); not built")
        if seq2seq:  # the whole encoder-decoder, fed decoder_input_ids
            return transformers.AutoModelForSeq2SeqLM.from_config(hf_config(tiny))
        return build_model(tiny, weights=True)

    name = f"{model_type}:seq2seq" if seq2seq else model_type
    return Entry(name, family, build, inputs)


def _torch_entries() -> list[Entry]:
    def encoder():
        layer = nn.TransformerEncoderLayer(64, 4, 128, dropout=0.1, batch_first=True)
        return nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)

    def transformer():
        return nn.Transformer(64, 4, 2, 2, 128, dropout=0.1, batch_first=True)

    hidden = lambda m: (torch.randn(EXAMPLE_BATCH, EXAMPLE_SEQ, 64, generator=torch.Generator().manual_seed(0)),)  # noqa: E731
    pair = lambda m: hidden(m) + (torch.randn(EXAMPLE_BATCH, EXAMPLE_SEQ // 2, 64),)  # noqa: E731
    return [Entry("nn.TransformerEncoder", "torch", encoder, hidden), Entry("nn.Transformer", "torch", transformer, pair)]


def entries(only: set[str] | None = None, extra: tuple[str, ...] = ()) -> list[Entry]:
    """Every zoo entry (or those named in ``only``), plus ``file.py:factory`` specs in ``extra``."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    out = [_hf_entry(t, "causal-lm") for t in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES]
    out += [_hf_entry(t, "encoder") for t in ENCODERS if t not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES]
    out += [_hf_entry(t, "encoder-decoder", _encoder_decoder_inputs, seq2seq=True) for t in ENCODER_DECODERS]
    out += _torch_entries()
    out += [Entry(spec, "example", lambda spec=spec: build_model(parse_spec(spec)), _token_ids)
            for spec in ("examples/gpt.py:build_gpt", "examples/llama.py:build_llama", *extra)]
    return [e for e in out if only is None or e.name in only]


def run_entry(entry: Entry, tp: int, limit_s: int = 300, sequence_parallel: bool = False) -> Result:
    """Build, plan and check one entry at ``tp`` (at most ``limit_s`` seconds), with sequence parallelism if asked."""
    start = time.perf_counter()
    try:
        torch.manual_seed(0)
        model = entry.build()
        inputs = entry.inputs(model)
        with torch.no_grad():
            model(*inputs, **model_kwargs(model))  # the model must run its own forward on these inputs
    except Exception as e:  # any failure to build or run is the entry's, not autotp's
        return Result(Status.NOT_BUILDABLE, notes=[_line(e)], seconds=time.perf_counter() - start)
    try:
        with _TimeLimit(limit_s):
            # coverage: can it split, exactly
            report = check(model, tp, inputs, vocab="split", sequence_parallel=sequence_parallel)
            used = {name: p.numel() for name, p in model.named_parameters() if name in report.read}
    except AutotpError as e:
        status = Status.CRASH if type(e).__name__ == "InternalError" else Status.REFUSED
        return Result(status, notes=[_line(e)], seconds=time.perf_counter() - start)
    except Exception as e:  # a raw error out of autotp is a bug: report it as one
        return Result(Status.CRASH, notes=[_line(e)], seconds=time.perf_counter() - start)
    return _verdict(report, model, used, time.perf_counter() - start)


def _verdict(report, model: nn.Module, used: dict[str, int], seconds: float) -> Result:
    if not report.exact:
        return Result(Status.MISMATCH, notes=[str(report.mismatch)], seconds=seconds)
    split = {n for n, p in report.plan.placements.items() if p.is_split}
    total = sum(used.values()) or 1
    fraction = sum(n for name, n in used.items() if name in split) / total
    shapes = dict(model.named_parameters())
    tables = _side_tables(model, report.plan)
    chosen = {name for name in used if any(within(name, layer) for layer in report.plan.by_choice)}
    whole = [name for name, n in used.items()
             if name not in split | tables | chosen and n >= SIZEABLE and shapes[name].dim() >= 2]
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


def _line(e: BaseException) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    return f"{type(e).__name__}: {text[:300]}"


class _TimeLimit:
    """Raise ``TimeoutError`` in the main thread after ``seconds`` (a model that hangs must not stop the sweep)."""

    def __init__(self, seconds: int):
        self.seconds = seconds

    def __enter__(self):
        def expire(*_):
            raise TimeoutError(f"took more than {self.seconds} s")
        self.previous = signal.signal(signal.SIGALRM, expire)
        signal.alarm(self.seconds)

    def __exit__(self, *exc):
        signal.alarm(0)
        signal.signal(signal.SIGALRM, self.previous)
        return False


def sweep(chosen: list[Entry], tps=(2, 4), progress=sys.stderr,
          sequence_parallel: bool = False) -> dict[str, dict[int, Result]]:
    """Every entry at every tp, printing one progress line per run."""
    out: dict[str, dict[int, Result]] = {}
    for i, entry in enumerate(chosen, 1):
        out[entry.name] = {}
        for tp in tps:
            result = run_entry(entry, tp, sequence_parallel=sequence_parallel)
            out[entry.name][tp] = result
            print(f"[{i}/{len(chosen)}] {entry.name} tp={tp}: {result.status.value} ({result.seconds:.1f} s)",
                  file=progress, flush=True)
    return out


def _cell(result: Result | None) -> str:
    return result.status.value if result is not None else "-"


def coverage_table(results: dict[str, dict[int, Result]], families: dict[str, str], tps=(2, 4),
                   sequence_parallel: bool = False) -> str:
    """``docs/COVERAGE.md``: counts at the top, then one row per model type."""
    first = {name: runs[tps[0]] for name, runs in results.items()}
    causal = [n for n in results if families[n] == "causal-lm"]
    buildable = [n for n in causal if first[n].status is not Status.NOT_BUILDABLE]
    counts = {s: sum(first[n].status is s for n in results) for s in Status}
    exact_causal = sum(first[n].status is Status.EXACT for n in buildable)
    lines = ["# Coverage", "",
             f"Every model autotp's zoo builds (`autotp zoo`), checked in one process with `autotp.check` at "
             f"tp={' and tp='.join(map(str, tps))}{' with sequence parallelism' if sequence_parallel else ''}: "
             "one training step (dropout on) compared with the unsharded model, "
             "output, loss, every gradient and every parameter after an SGD step.", "",
             f"- {len(results)} entries; at tp={tps[0]}: " + ", ".join(f"{n} {s.value}" for s, n in counts.items() if n),
             f"- causal-LM types: {len(causal)}, of which {len(buildable)} build tiny; {exact_causal} of those "
             f"({exact_causal / max(len(buildable), 1):.0%}) `exact` at tp={tps[0]}",
             "- `exact`: exact and every matrix the forward uses (at least 64x64; position and token-type tables, "
             "which Megatron keeps whole too, excepted) split, or kept whole by the planner's stated choice "
             "(`Plan.by_choice`: a transform before the LM head, a mixture-of-experts router); `partial`: exact, something "
             "kept whole (the notes say what and why); `refused`: a clear error; `not buildable`: the tiny config "
             "does not build. Split: the fraction of the parameters the forward reads that are split "
             "(parameters of towers the inputs never reach are not counted).", "",
             "| " + " | ".join(["type", "family", "status", *(f"tp={t}" for t in tps[1:]), "split", "notes"]) + " |",
             "|" + "---|" * (5 + len(tps) - 1)]
    for name, runs in results.items():
        result = runs[tps[0]]
        split = f"{result.split:.0%}" if result.split is not None else "-"
        notes = "; ".join(result.notes)[:400].replace("|", "/")
        cells = [f"`{name}`", families[name], result.status.value, *(_cell(runs.get(t)) for t in tps[1:]), split, notes]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    """``autotp zoo [--only a,b] [--tp 2 4] [-o FILE] [--file file.py:factory ...]``."""
    import argparse

    parser = argparse.ArgumentParser(prog="autotp zoo", description="check every model type, write the coverage table")
    parser.add_argument("--only", help="comma-separated entry names (default: all)")
    parser.add_argument("--tp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--file", action="append", default=[], metavar="FILE.py:FACTORY", help="extra models")
    parser.add_argument("-o", "--output", default="docs/COVERAGE.md", help="the table (- for stdout)")
    parser.add_argument("--sequence-parallel", action="store_true", help="check with sequence_parallel=True")
    args = parser.parse_args(argv)
    chosen = entries(set(args.only.split(",")) if args.only else None, tuple(args.file))
    torch.set_num_threads(max(1, torch.get_num_threads()))
    results = sweep(chosen, tuple(args.tp), sequence_parallel=args.sequence_parallel)
    table = coverage_table(results, {e.name: e.family for e in chosen}, tuple(args.tp), args.sequence_parallel)
    if args.output == "-":
        print(table)
    else:
        with open(args.output, "w", encoding="utf-8") as f:
            f.write(table)
        print(f"wrote {args.output}", file=sys.stderr)
    return 0
