"""The capture with and without its speed-ups, over the zoo: the same graph, and how much less CPU.

    python -m bench.shape_kernels                    # every zoo entry
    python -m bench.shape_kernels --every 4          # every fourth (a sample of every group)
    python -m bench.shape_kernels --only swin:image,gpt2

Each entry is captured twice in one process (``checker.prepare``, the train-mode capture), first with every speed-up
switched off (``capture_speedups=False``: torch's own kernels, no value computed once), then with them (the
``autotp.capture.speedups.shape_kernels`` stand-ins among them), and the two graphs are compared
node for node: op, target, arguments (by position) and every output's sizes, strides, dtype and gradient flag,
written as the same expressions. One line per entry; the exit status is 1 if any graph differs. The CPU seconds
printed favour the second capture slightly (torch's caches are warm by then); ``bench.windowed`` measures each
model in a fresh process.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch


def signature(gm: torch.fx.GraphModule) -> list:
    """Each node's op, target, arguments (by position) and output metas: what the stand-ins must not change."""
    index = {n: i for i, n in enumerate(gm.graph.nodes)}
    out = []
    for n in gm.graph.nodes:
        vals = n.meta.get("val")
        vals = vals if isinstance(vals, (tuple, list)) else (vals,)
        metas = [(tuple(map(str, v.shape)), tuple(map(str, v.stride())), v.dtype, v.requires_grad)
                 for v in vals if isinstance(v, torch.Tensor)]
        args = torch.fx.node.map_arg((n.args, n.kwargs), lambda a: f"%{index[a]}")
        out.append((n.op, "" if n.op == "placeholder" else str(n.target), str(args), metas))
    return out


def compare(entry) -> tuple[bool, float, float, int]:
    """(graphs equal, CPU s without, CPU s with, nodes) for one zoo entry."""
    from autotp.checker import prepare

    def built():
        """A fresh model for each capture: one that changes itself in its forward (BigBird drops its block-sparse
        attention on short inputs) would otherwise give the second capture another graph."""
        torch.manual_seed(0)
        model = entry.build()
        return model, entry.inputs(model)

    model, inputs = built()
    start = time.process_time()
    plain = prepare(model, inputs, speedups=False)
    plain_s = time.process_time() - start
    model, inputs = built()
    start = time.process_time()
    quick = prepare(model, inputs)
    quick_s = time.process_time() - start
    a, b = signature(plain.captured.module), signature(quick.captured.module)
    return a == b, plain_s, quick_s, len(a)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.shape_kernels", description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="comma-separated zoo entries (default: all)")
    parser.add_argument("--every", type=int, default=1, help="every N-th entry of the zoo's order")
    args = parser.parse_args(argv)
    from devtools.zoo import entries

    torch.set_num_threads(1)
    chosen = entries(set(args.only.split(",")) if args.only else None)[::args.every]
    different, plain_total, quick_total = [], 0.0, 0.0
    for entry in chosen:
        try:
            same, plain_s, quick_s, nodes = compare(entry)
        except Exception as e:  # an entry that does not build or capture is the zoo's to report
            print(f"{entry.name}: skipped ({type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''})",
                  flush=True)
            continue
        plain_total, quick_total = plain_total + plain_s, quick_total + quick_s
        different += [] if same else [entry.name]
        print(f"{entry.name}: {'same' if same else 'DIFFERENT'} graph, {nodes} nodes, "
              f"{plain_s:.2f} s without, {quick_s:.2f} s with", flush=True)
    print(f"{len(chosen)} entries, {len(different)} different{': ' + ', '.join(different) if different else ''}; "
          f"capture CPU {plain_total:.0f} s without, {quick_total:.0f} s with")
    return 1 if different else 0


if __name__ == "__main__":
    sys.exit(main())
