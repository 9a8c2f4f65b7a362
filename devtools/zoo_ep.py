"""The zoo's mixtures of experts at ``ep`` (``autotp zoo --ep 2``): every entry whose config has routed experts,
checked by ``autotp.check`` at tp=ep (the expert-parallel ranks the runtime takes today), with its verdict in a
column of ``docs/COVERAGE.md`` (between the markers below): its experts expert-split (whole experts per rank),
or kept under tensor parallelism with the plan's note saying why, and exact or not either way.

Which entries are mixtures of experts is read from their configs (a field counting experts), only to choose
what to sweep; what is expert-split is the planner's finding from the graph.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

from autotp.checker import check_prepared
from devtools.zoo_entries import build_reason
from devtools.zoo_results import Result
from autotp.passes.placement import PlacementKind
from autotp.passes.routed_experts import expert_layers

BEGIN, END = "<!-- zoo-ep: begin -->", "<!-- zoo-ep: end -->"
EXPERT_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
"""Config fields that count a model's routed experts (transformers' names for them)."""


def _counts_experts(config, depth: int = 0) -> bool:
    if config is None or depth > 2:
        return False
    if any(isinstance(getattr(config, f, None), int) and getattr(config, f) > 1 for f in EXPERT_FIELDS):
        return True
    return any(_counts_experts(getattr(config, sub, None), depth + 1) for sub in ("text_config", "ffn_config"))


def is_moe(entry) -> bool:
    """Whether ``entry``'s type has routed experts by its default config (False where none is known)."""
    import transformers

    kind = entry.name.split(":")[0]
    try:
        return _counts_experts(transformers.CONFIG_MAPPING[kind]())
    except Exception:  # not a transformers type, or its config does not build bare
        return False


def verdict(prepared, ep: int) -> tuple[str, str]:
    """(the ``ep`` column's cell, a note) for one prepared model: its experts expert-split or kept under tensor
    parallelism, and whether the check at tp=ep was exact."""
    layers = expert_layers(prepared.captured.analysis)
    if not layers:
        return "no router found", "no top-k routing was found in the graph: nothing to divide"
    report = check_prepared(prepared, ep, ep=ep, vocab="split")
    split = sorted(n for n, p in report.plan.placements.items() if p.kind is PlacementKind.EXPERT)
    kept = [n.split(": ", 2)[-1] for n in report.plan.notes if f"kept under tensor parallelism at ep={ep}" in n]
    exact = "exact" if report.exact else "MISMATCH"
    shape = f"{len(layers)} layers of {layers[0].experts} experts, top-{layers[0].top_k}"
    if split:
        return f"{exact}, expert-split", f"{shape}; {len(split)} banks split by their experts"
    return f"{exact}, kept under tp", f"{shape}; {kept[0] if kept else 'kept under tensor parallelism'}"


def run(entries, ep: int, prepared_of, outcome_of, limit_s: int = 240, progress=sys.stderr,
        on_result=None) -> dict[str, tuple[str, str]]:
    """Every mixture-of-experts entry's verdict at ``ep``, built and captured as the zoo does: ``prepared_of`` and
    ``outcome_of`` are its ``_prepared`` and ``_outcome`` (passed in: the zoo imports this module);
    ``on_result(results)`` after each entry (a long sweep stopped early keeps what it did)."""

    out = {}
    chosen = [e for e in entries if is_moe(e)]
    for i, entry in enumerate(chosen, 1):
        start = time.perf_counter()
        try:
            torch.manual_seed(0)
            model = entry.build()
            inputs = entry.inputs(model)
        except Exception as e:  # the entry's, not autotp's
            out[entry.name] = ("not buildable", build_reason(e))
            if on_result is not None:
                on_result(out)
            continue
        prepared, model, _ = prepared_of(model, inputs, limit_s, start)
        result = prepared if isinstance(prepared, Result) else outcome_of(lambda: verdict(prepared, ep), limit_s, start)
        out[entry.name] = ((result.status.value, "; ".join(result.notes)[:300]) if isinstance(result, Result)
                           else result)
        print(f"[{i}/{len(chosen)}] {entry.name} ep={ep}: {out[entry.name][0]} ({time.perf_counter() - start:.1f} s)",
              file=progress, flush=True)
        if on_result is not None:
            on_result(out)
    return out


def ep_section(results: dict[str, tuple[str, str]], ep: int, note: str = "") -> str:
    """The coverage page's section for ``results``, between the markers."""
    lines = [BEGIN, f"## Mixtures of experts at ep={ep}", "",
             f"Every zoo type whose config has routed experts, checked by `autotp.check` at tp={ep}, ep={ep} "
             "(`autotp zoo --ep " f"{ep}`): its experts divided among the ranks as whole experts "
             "(`expert-split`), or kept under tensor parallelism with the plan's note saying why (exact either way, "
             "or a `MISMATCH`, which would be autotp's bug)." + (f" {note}" if note else ""), "",
             f"| type | ep={ep} | note |", "|---|---|---|"]
    lines += [f"| {name} | {cell} | {why.replace('|', '/')} |" for name, (cell, why) in sorted(results.items())]
    return "\n".join([*lines, END, ""])


def with_section(page: str, section: str) -> str:
    """``page`` with its ep section replaced by ``section`` (appended when it has none)."""
    if BEGIN in page and END in page:
        head, rest = page.split(BEGIN, 1)
        return head + section.rstrip("\n") + rest.split(END, 1)[1]
    return page.rstrip("\n") + "\n\n" + section


def save(path: str, results: dict[str, tuple[str, str]]) -> None:
    """Write ``results`` as JSON (to merge parallel sweeps with ``load``)."""
    Path(path).write_text(json.dumps(results, indent=1, sort_keys=True) + "\n", encoding="utf-8")


def load(paths) -> dict[str, tuple[str, str]]:
    """Saved sweeps' results, later files winning."""
    out: dict[str, tuple[str, str]] = {}
    for path in paths:
        out |= {k: tuple(v) for k, v in json.loads(Path(path).read_text(encoding="utf-8")).items()}
    return out
