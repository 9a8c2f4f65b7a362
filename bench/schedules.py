"""Pipeline schedules against 1F1B, and activation recompute: step time, and the bytes recompute saves.

    python -m bench.schedules [--rounds 10]

Two gloo ranks on the CPU (one thread each). *Schedules*: autotp at tp=1, pp=2 steps the GPT below
(``pm.step(x, target=y)``) through every schedule (``options.Schedule``), 8 microbatches, plus 1F1B and ZBV with
``recompute="blocks"``, alternating in one run; a step's time is the slower rank's, each schedule's ratio to
1F1B paired by round with a 95% bootstrap interval. Every schedule's loss is the same step's loss (dropout off).
*Recompute*: the same GPT with dropout 0.1 at tp=2: bytes autograd keeps for backward in one forward
(parameters excluded; ``bench.memory.SavedActivations``) and step time, with and without ``recompute="blocks"``,
next to the cost model's prediction (``planning.recompute_cost``).
"""

from __future__ import annotations

from pathlib import Path

import torch

import autotp
from autotp.capture import capture, example_inputs_of
from autotp.options import Schedule
from autotp.planning.recompute_cost import plan_recompute_cost
from bench.config import ModelShape
from bench.memory import SavedActivations
from bench.runtime import alternate, two_rank_command
from bench.stats import paired_ratio, summary, with_interval
from examples.gpt import build_gpt

SHAPE = ModelShape(n_layer=8, n_head=4, n_embd=128, vocab_size=4096, batch=8, seq=64)
MICROBATCHES = 8
PIPELINES = {s.value: (s.value, "none") for s in Schedule} | {"1f1b+recompute": ("1f1b", "blocks"),
                                                              "zbv+recompute": ("zbv", "blocks")}
RESULTS = Path(__file__).parent / "results" / "schedules.json"


def _drop_grads(pm) -> None:
    for p in pm.parameters():
        p.grad = None


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return tuple(torch.randint(0, SHAPE.vocab_size, (SHAPE.batch, SHAPE.seq), generator=gen) for _ in range(2))


def _schedules(world: int, rounds: int) -> dict:
    torch.manual_seed(0)
    model = build_gpt(**SHAPE.gpt_kwargs())
    x, y = _batch()
    pms = {name: autotp.parallelize(model, tp=1, pp=world, example_inputs=x, microbatches=MICROBATCHES,
                                    schedule=schedule, recompute=recompute)
           for name, (schedule, recompute) in PIPELINES.items()}
    losses = {}
    for name, pm in pms.items():
        losses[name] = float(pm.step(x, target=y))
        _drop_grads(pm)
    samples = alternate({n: (lambda pm=pm: (pm.step(x, target=y), _drop_grads(pm))) for n, pm in pms.items()},
                        rounds)
    return {"losses": losses, "times": {n: summary(s) for n, s in samples.items()},
            "vs 1f1b": {n: paired_ratio(s, samples["1f1b"]) for n, s in samples.items() if n != "1f1b"}}


def _saved_bytes(pm, x, y) -> int:
    saved = SavedActivations(list(pm.parameters()))
    with saved:
        loss = pm.loss(x, target=y)
    loss.backward()
    _drop_grads(pm)
    return saved.bytes


def _recompute(world: int, rounds: int) -> dict:
    torch.manual_seed(0)
    model = build_gpt(**(SHAPE.gpt_kwargs() | {"dropout": 0.1}))
    x, y = _batch()
    pms = {mode: autotp.parallelize(model, tp=world, example_inputs=x, recompute=mode) for mode in ("none", "blocks")}
    losses = {}
    for mode, pm in pms.items():
        pm.manual_seed(3)
        losses[mode] = float(pm.loss(x, target=y).detach())
    saved = {mode: _saved_bytes(pm, x, y) for mode, pm in pms.items()}
    predicted = plan_recompute_cost(capture(model, example_inputs_of(model, x), training=True),
                                    pms["none"].plan)
    samples = alternate({m: (lambda pm=pm: (pm.step(x, target=y), _drop_grads(pm))) for m, pm in pms.items()},
                        rounds)
    return {"tp": world, "losses": losses, "saved bytes per rank": saved,
            "predicted saving": predicted.saved_bytes, "predicted extra FLOPs": predicted.extra_flops,
            "times": {m: summary(s) for m, s in samples.items()},
            "blocks / none": paired_ratio(samples["blocks"], samples["none"])}


def _measure(rank: int, world: int, rounds: int) -> dict:
    return {"shape": SHAPE.describe(), "microbatches": MICROBATCHES, "schedules": _schedules(world, rounds),
            "recompute": _recompute(world, rounds)}


def table(r: dict) -> str:
    """The results as two Markdown tables."""
    s, mib = r["schedules"], 2 ** 20
    lines = ["| schedule (pp=2) | loss | step (median) | / 1F1B |", "|---|---|---|---|"]
    for name, t in s["times"].items():
        ratio = with_interval(s["vs 1f1b"][name]) if name in s["vs 1f1b"] else "1"
        lines.append(f"| {name} | {s['losses'][name]:.6f} | {t['median'] * 1e3:.1f} ms | {ratio} |")
    c = r["recompute"]
    saved = c["saved bytes per rank"]
    lines += ["", f"| tp={c['tp']}, dropout 0.1 | none | blocks | ratio |", "|---|---|---|---|",
              f"| saved for backward per rank | {saved['none'] / mib:.2f} MiB | {saved['blocks'] / mib:.2f} MiB | "
              f"{saved['blocks'] / saved['none']:.3f} |",
              f"| saving predicted (cost model) | | {c['predicted saving'] / mib:.2f} MiB | measured "
              f"{(saved['none'] - saved['blocks']) / mib:.2f} MiB |",
              f"| step time (median) | {c['times']['none']['median'] * 1e3:.1f} ms | "
              f"{c['times']['blocks']['median'] * 1e3:.1f} ms | {with_interval(c['blocks / none'])} |"]
    return "\n".join(lines)


def main(argv=None) -> None:
    """Measure, print the tables, write ``bench/results/schedules.json``."""
    r = two_rank_command(_measure, __doc__, RESULTS, argv)
    print(f"{r['shape']}, {r['microbatches']} microbatches; recompute losses {r['recompute']['losses']}")
    print(table(r))


if __name__ == "__main__":
    main()
