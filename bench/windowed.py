"""Windowed and relative-position models against plain ones of their size: CPU seconds to capture, plan and check.

    python -m bench.windowed                 # the table on stdout
    python -m bench.windowed --tp 4

The Swin family and BEiT (relative-position bias per layer) against ViTs, DeBERTa-v2 (relative-position
attention) against BERT. Each model runs in a fresh process (its imports first), at the zoo's tiny config
(``autotp zoo``'s entries) or a matched config: for ``vit-matched``, a ViT as deep as the tiny Swin (8 layers) with about its parameter count, on the same
64 x 64 images in 4 x 4 patches; ``bert-8`` and ``deberta-v2-8``, one config (8 layers of width 256, 4 heads)
for both, on 2 x 128 tokens. *capture* is ``checker.prepare`` (the train-mode capture), *plan* ``make_plan``,
*check* the one-process check of every rank against the model (``check_prepared``, which plans again).
*autotp.plan* is what a user's ``autotp plan`` runs (a process of its own, cold): where a model's blocks repeat
(three or more alike), two are captured and the rest stamped out (``capture.repeats``), so this is the planning
time a user sees; *capture* is the full capture the check and the rewrite make. *torch.export alone* is a bare
``torch.export.export`` of the whole model with static sizes (a process of its own, cold, no autotp code): the
least any planner tracing every block through torch.export pays, and where blocks cannot be stamped, a floor under
*autotp.plan*.
CPU time (``time.process_time``), not wall time: the machine is shared.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

MODELS = ("vit:image", "deit:image", "vit-matched", "beit-matched", "swin:image", "swin:backbone", "swinv2:image",
          "swinv2:backbone", "donut-swin:image", "maskformer-swin:backbone", "bert:mlm", "deberta-v2:mlm", "bert-8",
          "deberta-v2-8")

VIT_MATCHED = {"hidden_size": 320, "num_hidden_layers": 8, "num_attention_heads": 8, "intermediate_size": 1280,
               "image_size": 64, "patch_size": 4, "num_labels": 10}
"""A ViT of the tiny Swin's depth (4 stages of 2 layers) and about its 9M parameters; ``beit-matched`` is BEiT at
this config with a relative-position bias in every layer and its default stochastic depth (a rate per layer)."""

TEXT_MATCHED = {"hidden_size": 256, "num_hidden_layers": 8, "num_attention_heads": 4, "intermediate_size": 1024,
                "vocab_size": 1024, "max_position_embeddings": 512}
"""``bert-8`` and ``deberta-v2-8``: one config for both."""

DEBERTA_RELATIVE = {"relative_attention": True, "pos_att_type": ["p2c", "c2p"], "position_buckets": 256,
                    "max_relative_positions": -1, "position_biased_input": False, "norm_rel_ebd": "layer_norm",
                    "share_att_key": True}
"""What ``deberta-v2-8`` adds: DeBERTa-v3's relative-position attention (the zoo's tiny DeBERTa-v2 keeps the
config's defaults, which turn it off)."""

_CHILD = r"""
import json, sys, time
import torch
torch.set_num_threads(1)
from autotp.checker import check_prepared, prepare
from autotp.options import Options
from autotp.planning import make_plan
from autotp.passes.region_match import RegionKind
from devtools.zoo import entries  # every child imports what the zoo's do, so no capture pays an import
name, tp, vit, text, relative = sys.argv[1], int(sys.argv[2]), *map(json.loads, sys.argv[3:6])
part = sys.argv[6]
torch.manual_seed(0)
if name in ("vit-matched", "beit-matched"):
    import transformers
    model = (transformers.ViTForImageClassification(transformers.ViTConfig(**vit)) if name == "vit-matched" else
             transformers.BeitForImageClassification(transformers.BeitConfig(**vit, use_relative_position_bias=True)))
    inputs = {"pixel_values": torch.randn(2, 3, vit["image_size"], vit["image_size"])}
elif name in ("bert-8", "deberta-v2-8"):
    import transformers
    model = (transformers.BertForMaskedLM(transformers.BertConfig(**text)) if name == "bert-8" else
             transformers.DebertaV2ForMaskedLM(transformers.DebertaV2Config(**text, **relative)))
    inputs = {"input_ids": torch.randint(0, text["vocab_size"], (2, 128))}
else:
    (entry,) = entries({name})
    model = entry.build()
    inputs = entry.inputs(model)
if part == "plan":  # what `autotp plan` and autotp.plan run, cold: blocks that repeat are captured once and stamped
    import autotp
    start = time.process_time()
    autotp.plan(model, tp, inputs)
    print(json.dumps({"autotp_plan_s": time.process_time() - start}))
    sys.exit(0)
if part == "export":  # torch's own cost of tracing every block once, with no symbolic sizes to carry
    start = time.process_time()
    torch.export.export(model, (), inputs, strict=False)
    print(json.dumps({"export_s": time.process_time() - start}))
    sys.exit(0)
start = time.process_time()
prepared = prepare(model, inputs)
caught = time.process_time()
plan = make_plan(prepared.captured, Options(tp=tp))
planned = time.process_time()
report = check_prepared(prepared, tp, vocab="split")
checked = time.process_time()
attention = [r for r in plan.regions if r.kind == RegionKind.ATTENTION]
print(json.dumps({"model": name, "params": sum(p.numel() for p in model.parameters()),
                  "nodes": len(prepared.captured.graph.nodes), "capture_s": caught - start,
                  "plan_s": planned - caught, "check_s": checked - planned, "exact": report.exact,
                  "attention": len(attention), "split_attention": sum(bool(r.columns) for r in attention),
                  "example": attention[0].to_dict() if attention else None}))
"""


def measure(name: str, tp: int) -> dict:
    """One model in three fresh processes: ``autotp.plan`` as a user runs it, a bare static ``torch.export``, then
    capture, plan and check apart."""
    row = {}
    configs = [json.dumps(VIT_MATCHED), json.dumps(TEXT_MATCHED), json.dumps(DEBERTA_RELATIVE)]
    for part in ("plan", "export", "parts"):
        out = subprocess.run([sys.executable, "-c", _CHILD, name, str(tp), *configs, part],
                             capture_output=True, text=True)
        if out.returncode:
            return {"model": name, "error": (out.stderr.strip().splitlines() or ["?"])[-1][:200]}
        row.update(json.loads(out.stdout.strip().splitlines()[-1]))
    return row


PLAIN_OF = {"beit-matched": "vit-matched", "swin:image": "vit-matched", "swin:backbone": "vit-matched", "swinv2:image": "vit-matched",
            "swinv2:backbone": "vit-matched", "donut-swin:image": "vit-matched",
            "maskformer-swin:backbone": "vit-matched", "deberta-v2-8": "bert-8"}
"""Each windowed or relative-position model -> the plain model of its size it is measured against."""


def _seconds(row: dict, what: str) -> float:
    """``capture+plan``: the full capture and the plan apart; ``autotp.plan``: the user's call; ``export``: the bare
    static torch.export."""
    if what == "export":
        return row["export_s"]
    return row["autotp_plan_s"] if what == "autotp.plan" else row["capture_s"] + row["plan_s"]


def _ratio(row: dict, rows: list[dict], what: str = "capture+plan", against: str | None = None) -> str:
    """Planning time (``what``: see ``_seconds``) as a multiple of its plain model's (``against``, that model's
    time of the same kind unless named), when that ran in the same table."""
    plain = next((r for r in rows if r["model"] == PLAIN_OF.get(row["model"]) and "error" not in r), None)
    if plain is None:
        return "-"
    return f"{_seconds(row, what) / _seconds(plain, against or what):.2f}"


def markdown(rows: list[dict], tp: int, load: tuple[float, float]) -> str:
    """The table, with the load average at the start and the end."""
    out = [f"tp={tp}; load average {load[0]:.1f} at the start, {load[1]:.1f} at the end (2 cores, shared).", "",
           "| model | params | graph nodes | autotp.plan s | to its plain model | torch.export alone s "
           "| to its plain model's autotp.plan | capture s | plan s | capture + plan s | to its plain model | check s "
           "| attention regions split by heads | exact |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        if "error" in r:
            out.append(f"| {r['model']} | - | - | - | - | - | - | - | - | - | - | - | - | {r['error']} |")
            continue
        out.append(f"| {r['model']} | {r['params'] / 1e6:.1f}M | {r['nodes']} | {r['autotp_plan_s']:.2f} | "
                   f"{_ratio(r, rows, 'autotp.plan')} | {r['export_s']:.2f} | "
                   f"{_ratio(r, rows, 'export', against='autotp.plan')} | {r['capture_s']:.2f} | "
                   f"{r['plan_s']:.2f} | {r['capture_s'] + r['plan_s']:.2f} | {_ratio(r, rows)} | "
                   f"{r['check_s']:.1f} | {r['split_attention']} of {r['attention']} | "
                   f"{'yes' if r['exact'] else 'NO'} |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.windowed", description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--only", default=",".join(MODELS), help="comma-separated models")
    parser.add_argument("--json", help="also write the rows here")
    args = parser.parse_args(argv)
    start = os.getloadavg()[0]
    rows = []
    for name in args.only.split(","):
        rows.append(measure(name, args.tp))
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(rows, f, indent=1)
    print(markdown(rows, args.tp, (start, os.getloadavg()[0])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
