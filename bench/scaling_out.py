"""Parameter and optimizer bytes per rank with data parallelism, against the whole model's over tp·pp·dp.

    python -m bench.scaling_out [--layers 4] [--width 256]

One spawn of 8 gloo ranks on the CPU (one thread each) runs every (dp, tp, pp) layout, the largest worlds
first (a smaller one re-forms the group from the first ranks). Each layout takes one AdamW step on its
slice of a batch, so the optimizer state exists, then every rank reports its bytes: the local shards of its
parameters and of AdamW's two moments (FSDP's DTensors counted by their local shard, tied tensors once).
The table gives the largest rank's bytes and their ratio to (parameters + moments of the whole model) /
(tp·pp·dp): 1.00 is a perfect split.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

import autotp
from bench.memory import optimizer_bytes, tensor_bytes
from bench.ranks import reform_world, run_on_ranks
from examples.gpt import build_gpt

LAYOUTS = [(2, 2, 2, "fsdp"), (8, 1, 1, "fsdp"), (4, 2, 1, "fsdp"), (2, 2, 2, "replicate"), (4, 1, 1, "fsdp"),
           (2, 2, 1, "fsdp"), (2, 1, 2, "fsdp"), (2, 1, 1, "fsdp"), (2, 1, 1, "replicate"), (1, 1, 1, "fsdp")]
"""(dp, tp, pp, dp_mode), the largest worlds first."""
BATCH, SEQ = 8, 32


def _measure(dp: int, tp: int, pp: int, mode: str, layers: int, width: int) -> dict:
    torch.manual_seed(0)
    model = build_gpt(n_layer=layers, n_head=4, n_embd=width, vocab_size=256, block_size=SEQ)
    x = torch.randint(0, 256, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    pm = autotp.parallelize(model, tp=tp, pp=pp, dp=dp, dp_mode=mode, example_inputs=(x[:2],),
                            microbatches=2 if pp > 1 else None)
    rows = slice(pm.dp_rank * BATCH // dp, (pm.dp_rank + 1) * BATCH // dp)
    opt = torch.optim.AdamW(pm.parameters())
    pm.step(x[rows], target=x[rows])
    opt.step()
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    mine = [tensor_bytes(pm.parameters()), optimizer_bytes(opt)]
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    params, moments = max(e[0] for e in everyone), max(e[1] for e in everyone)
    ideal = 3 * total / (tp * pp * dp)  # parameters + AdamW's two moments
    return {"layout": f"dp={dp} tp={tp} pp={pp}", "mode": mode, "ranks": dp * tp * pp, "params": params,
            "moments": moments, "ideal": ideal, "ratio": (params + moments) / ideal, "model": total}


def _run(rank: int, world: int, layers: int, width: int) -> list[dict]:
    rows = []
    for dp, tp, pp, mode in LAYOUTS:
        if not reform_world(dp * tp * pp, "cpu"):
            break
        rows.append(_measure(dp, tp, pp, mode, layers, width))
    return rows


def table(rows: list[dict]) -> str:
    """The markdown table of the measurements (bytes in MiB)."""
    mib = 2**20
    lines = [f"GPT, {rows[0]['model'] / mib:.2f} MiB of fp32 parameters (+ 2x that in AdamW moments)", "",
             "| layout | dp mode | ranks | params / rank (MiB) | AdamW moments / rank (MiB) | "
             "(params + moments) / (total / (tp·pp·dp)) |",
             "|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r["ranks"], r["mode"])):
        mode = r["mode"] if r["ranks"] > 1 and not r["layout"].startswith("dp=1 ") else "-"
        lines.append(f"| {r['layout']} | {mode} | {r['ranks']} | {r['params'] / mib:.3f} | "
                     f"{r['moments'] / mib:.3f} | {r['ratio']:.2f} |")
    return "\n".join(lines)


def main() -> None:
    """Run every layout on 8 gloo ranks and print the table."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=256)
    args = p.parse_args()
    print(table(run_on_ranks(_run, "cpu", [1] * 8, args.layers, args.width)[0]))


if __name__ == "__main__":
    main()
