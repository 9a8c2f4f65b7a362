"""What DTensor parameters cost a training step: the same tp=2 step with and without them, in one run.

    python -m bench.dtensor_cost [--rounds 30]

A 4-layer GPT (hidden 256, 8 heads, vocabulary 8192, batch 4 x 128: bench.megatron_core's shape) is parallelized
three times on 2 gloo ranks: ``dtensor`` (parameters are DTensors read through autotp's local read, replicated
parameters fingerprinted in the batch check: what ``parallelize`` builds), ``torch_reads`` (the same, its graphs
reading the parameters through torch's own ``DTensor.to_local``: what autotp ran before its local read) and
``plain`` (parameters left plain and no fingerprints). One step of each (forward, loss, backward, torch's AdamW
with ``foreach=True``, ``zero_grad``) takes turns, order rotated; ratios are medians of per-round ratios with 95%
intervals. The DTensor shares are measured alone too, in CPU time of this process (other load on the machine
counts less there): the parameters' local reads with their backward (autotp's, torch's ``to_local``, plain), and
AdamW's step over the same parameters (defaults, ``foreach``, ``fused``), DTensors against their local tensors.
"""

from __future__ import annotations

import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

import autotp
import autotp.api
from autotp.rewrite.local_reads import to_local
from autotp.runtime.drift import Fingerprints
from bench.runtime import alternate, two_rank_command
from bench.stats import paired_ratio, summary, with_interval

RESULTS = Path(__file__).parent / "results" / "dtensor_cost.json"


def _plain(model, x):
    """``model`` parallelized with plain parameters (as autotp did before DTensor parameters) and no fingerprints."""
    keep = autotp.api.expressible, autotp.api.warn_plain
    autotp.api.expressible, autotp.api.warn_plain = (lambda plan: False), (lambda plan: None)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            pm = autotp.parallelize(model, tp=2, example_inputs=(x,), quiet=True)
    finally:
        autotp.api.expressible, autotp.api.warn_plain = keep
    pm._replicated = Fingerprints({})
    return pm


def _torch_to_local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local()


def _torch_reads(pm) -> None:
    """Have ``pm``'s graphs read their DTensor parameters through torch's ``to_local`` (the local read before)."""
    for gm in pm.modules():
        if isinstance(gm, torch.fx.GraphModule) and any(n.target is to_local for n in gm.graph.nodes):
            for node in gm.graph.nodes:
                if node.target is to_local:
                    node.target = _torch_to_local
            gm.recompile()


def _cpu_median(run, rounds: int) -> float:
    """Median CPU seconds of this process over ``rounds`` calls of ``run`` (after one untimed call)."""
    run()
    samples = []
    for _ in range(rounds):
        start = time.process_time()
        run()
        samples.append(time.process_time() - start)
    return statistics.median(samples)


def _optimizer_seconds(params: list, rounds: int, **kind) -> float:
    """Median CPU seconds of AdamW's step (torch's defaults, or ``kind``: foreach, fused) over ``params``' gradients
    (set to ones)."""
    params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    for p in params:
        p.grad = torch.ones_like(p)
    return _cpu_median(torch.optim.AdamW(params, lr=1e-4, **kind).step, rounds)


def _read_seconds(params: list, read, rounds: int) -> float:
    """Median CPU seconds of reading every parameter through ``read``, a backward through the reads, and dropping
    the gradients: the local reads' share of a step, without the model's arithmetic."""
    def run():
        sum(read(p).sum() for p in params).backward()
        for p in params:
            p.grad = None
    return _cpu_median(run, rounds)


def _cpu_shares(dtensors: list, rounds: int) -> dict:
    """The CPU cost of DTensor parameters outside the model's arithmetic: the local reads (autotp's, torch's
    ``to_local``, plain parameters) and AdamW's step (defaults, foreach, fused; DTensors and their local tensors)."""
    plain = [torch.nn.Parameter(p.to_local().detach().clone()) for p in dtensors]
    reads = {"autotp": _read_seconds(dtensors, to_local, rounds),
             "torch to_local": _read_seconds(dtensors, _torch_to_local, rounds),
             "plain": _read_seconds(plain, lambda p: p, rounds)}
    adamw = {f"{kind or 'default'} {name}": _optimizer_seconds(params, rounds, **({kind: True} if kind else {}))
             for kind in (None, "foreach", "fused") for name, params in (("dtensor", dtensors), ("plain", plain))}
    return {"reads": reads, "adamw": adamw}


def _measure(rank: int, world: int, rounds: int) -> dict:
    from examples.gpt import build_gpt

    torch.manual_seed(0)
    model = build_gpt(n_layer=4, n_embd=256, n_head=8, vocab_size=8192, block_size=128)
    x, y = (torch.randint(0, 8192, (4, 128), generator=torch.Generator().manual_seed(s)) for s in (1, 2))
    built = {"dtensor": autotp.parallelize(model, tp=2, example_inputs=(x,), quiet=True),
             "torch_reads": autotp.parallelize(model, tp=2, example_inputs=(x,), quiet=True), "plain": _plain(model, x)}
    _torch_reads(built["torch_reads"])

    def stepper(pm):
        opt = torch.optim.AdamW(pm.parameters(), lr=1e-4, foreach=True)  # the setting training.md recommends

        def run():
            pm.step(x, target=y)
            opt.step()
            opt.zero_grad()
        return run

    samples = alternate({name: stepper(pm) for name, pm in built.items()}, rounds)
    shares = _cpu_shares(list(built["dtensor"].parameters()), rounds)
    return {"times": {k: summary(v) for k, v in samples.items()},
            "dtensor / plain": paired_ratio(samples["dtensor"], samples["plain"]),
            "torch_reads / plain": paired_ratio(samples["torch_reads"], samples["plain"]),
            "torch_reads / dtensor": paired_ratio(samples["torch_reads"], samples["dtensor"]),
            "cpu seconds": shares}


def main(argv=None) -> int:
    """Measure, print, write ``bench/results/dtensor_cost.json``."""
    r = two_rank_command(_measure, __doc__, RESULTS, argv)
    times = {k: f"{v['median'] * 1e3:.1f} ms" for k, v in r["times"].items()}
    cpu = {share: {k: f"{v * 1e3:.1f} ms" for k, v in values.items()} for share, values in r["cpu seconds"].items()}
    print(f"tp=2 step with AdamW(foreach=True): {times}; dtensor / plain {with_interval(r['dtensor / plain'])}; with torch's "
          f"to_local reads / plain {with_interval(r['torch_reads / plain'])}; CPU time of the reads (forward and "
          f"backward) and of AdamW's step: {cpu}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
