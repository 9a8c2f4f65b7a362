"""The zoo's coverage table (``docs/COVERAGE.md``), grouped by task with each group's counts, and the
results saved as JSON so that sweeps run apart (one task group at a time) make one table."""

from __future__ import annotations

import json
import os

from devtools.zoo_results import Result, Status

COUNTED = (Status.EXACT, Status.PARTIAL, Status.REFUSED, Status.NOT_BUILDABLE, Status.TIMEOUT, Status.MISMATCH,
           Status.CRASH)

DEFINITIONS = (
    "- `exact`: exact and every matrix the forward uses (at least 64x64; position and token-type tables, and "
    "parameters only added or joined to the activations, such as position tables and class tokens, which Megatron "
    "keeps whole too, excepted, and so are dense convolutions over the model's inputs, a patch embedding or stem, "
    "which Megatron's vision models keep whole too) split, or kept whole by the planner's stated choice "
    "(`Plan.by_choice`: a "
    "transform before the LM head, a mixture-of-experts router); `partial`: exact, something kept whole (the notes "
    "say what and why); `refused`: a clear error; `not buildable`: the tiny config does not build (the reason is "
    "the model's: its default config does not build either, or a part no config field sizes stays large). Split: "
    "the fraction of the parameters the forward reads that are split (parameters of towers the inputs never reach, "
    "such as a vision-language model's vision tower under text-only inputs, are not counted). `MISMATCH` and "
    "`CRASH` would be autotp's bugs.")

GROUP_NOTES = {
    "sequence-classification": "types whose trunk no language-model group above checks",
    "token-classification": "types whose trunk no language-model group above checks",
    "image-text-to-text": "fed text only, and images where the forward requires them",
}


ORDER = ("causal-lm", "masked-lm", "seq2seq-lm", "sequence-classification", "token-classification",
         "image-classification", "backbone", "speech-seq2seq", "ctc", "image-text-to-text", "diffusers", "timm", "torch",
         "example")
"""The groups in the table's order (the zoo's task groups, then the other libraries'); any other after them."""


def _rank(family: str) -> tuple[int, str]:
    return (ORDER.index(family) if family in ORDER else len(ORDER), family)


def save_results(path: str, results: dict[str, dict[int, Result]], families: dict[str, str]) -> None:
    """Write a sweep's results (every entry's family, and its result at each tp) as JSON."""
    data = {name: {"family": families[name],
                   "runs": {str(tp): {"status": r.status.value, "split": r.split, "notes": r.notes,
                                      "seconds": round(r.seconds, 1)} for tp, r in runs.items()}}
            for name, runs in results.items()}
    partial = f"{path}.partial"  # written beside it, then renamed: a sweep stopped mid-write keeps the last save
    with open(partial, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1)
    os.replace(partial, path)


def load_results(paths: list[str]) -> tuple[dict[str, dict[int, Result]], dict[str, str]]:
    """Results and families from saved sweeps; an entry in a later file replaces the earlier one's runs at the
    tps it has."""
    results: dict[str, dict[int, Result]] = {}
    families: dict[str, str] = {}
    for path in paths:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        for name, item in data.items():
            families[name] = item["family"]
            runs = results.setdefault(name, {})
            for tp, r in item["runs"].items():
                runs[int(tp)] = Result(Status(r["status"]), r["split"], r["notes"], r["seconds"])
    return results, families


def _count(results: dict[str, dict[int, Result]], names: list[str], tp: int) -> str:
    listed = [results[n][tp] for n in names if tp in results[n]]
    ran = [r for r in listed if r.status is not Status.PENDING]
    pending = f" ({len(listed) - len(ran)} pending)" if len(ran) < len(listed) else ""
    if not ran:
        return "not run" + pending
    counts = [f"{sum(r.status is s for r in ran)} {s.value}" for s in COUNTED if any(r.status is s for r in ran)]
    buildable = [r for r in ran if r.status is not Status.NOT_BUILDABLE]
    exact = sum(r.status is Status.EXACT for r in buildable)
    share = f" — {exact}/{len(buildable)} ({exact / len(buildable):.0%}) of the buildable exact" if buildable else ""
    partial_run = f" (of {len(listed)} run)" if len(listed) < len(names) else ""
    return ", ".join(counts) + share + partial_run + pending


def coverage_table(results: dict[str, dict[int, Result]], families: dict[str, str], tps=(2, 4),
                   sequence_parallel: bool = False, note: str = "") -> str:
    """``docs/COVERAGE.md``: what is checked (and ``note``: which sweep, at which commit), then per task group its
    counts at each tp and one row per model."""
    groups: dict[str, list[str]] = {}
    for name in sorted(results):
        groups.setdefault(families[name], []).append(name)
    groups = dict(sorted(groups.items(), key=lambda item: _rank(item[0])))
    lines = ["# Coverage", "",
             f"Every model autotp's zoo builds (`autotp zoo`), checked in one process with `autotp.check` at "
             f"tp={' and tp='.join(map(str, tps))}{' with sequence parallelism' if sequence_parallel else ''}: "
             "one training step (dropout on) compared with the unsharded model, output, loss, every gradient and "
             "every parameter after an SGD step. Tiny configs of every model type of transformers' task mappings, "
             "diffusers' and timm's transformers, torch's own and the examples.", "", *([note, ""] if note else []),
             DEFINITIONS, "",
             "| group | entries | " + " | ".join(f"tp={t}" for t in tps) + " |", "|---|---|" + "---|" * len(tps)]
    for family, names in groups.items():
        note = f" ({GROUP_NOTES[family]})" if family in GROUP_NOTES else ""
        lines.append(f"| {family}{note} | {len(names)} | " + " | ".join(_count(results, names, t) for t in tps) + " |")
    for family, names in groups.items():
        lines += ["", f"## {family}", "",
                  "| " + " | ".join(["type", "status", *(f"tp={t}" for t in tps[1:]), "split", "notes"]) + " |",
                  "|" + "---|" * (4 + len(tps) - 1)]
        for name in names:
            runs = results[name]
            first = runs.get(tps[0])
            split = f"{first.split:.0%}" if first is not None and first.split is not None else "-"
            notes = "; ".join(first.notes if first else [])[:400].replace("|", "/")
            cells = [f"`{name}`", _cell(first), *(_cell(runs.get(t)) for t in tps[1:]), split, notes]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _cell(result: Result | None) -> str:
    return result.status.value if result is not None else "-"
