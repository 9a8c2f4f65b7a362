"""The one-process checker on one GPU: is a rewrite as exact on CUDA as on the CPU, in fp32 and in bf16?

    python -m bench.one_gpu                          # the default models, tp=2 and 4, fp32 and bf16
    python -m bench.one_gpu --models llama,bert:mlm --dtypes fp32 --json out.json

NCCL needs a GPU per rank (it refuses two ranks on one device), so a machine with one GPU cannot time a
tensor-parallel step; what it can show is the rewrite's arithmetic on CUDA kernels. Each zoo model is built
on the GPU in the dtype asked for and checked with ``autotp.check`` (every rank simulated as a thread, one
training step compared with the unsharded model: output, loss, every gradient and the parameters after SGD).
In bf16 a split sums partial products in another order, so a bf16 row is judged by the checker's float64
replay (``rounding``: the same function, rounded differently), as a reader of fp32 results would judge them.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from torch.utils._pytree import tree_map

import autotp
from devtools.zoo import entries
from devtools.tiny import quiet

DEFAULT_MODELS = ("examples/gpt.py:build_gpt", "llama", "qwen3_moe", "bert:mlm", "deberta-v2:mlm", "vit:image",
                  "whisper:speech", "nn.Transformer")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _to(value, device: torch.device, dtype: torch.dtype):
    """``value`` on ``device``; floating tensors in ``dtype`` (token ids and masks of other dtypes stay as they are)."""
    if not isinstance(value, torch.Tensor):
        return value
    return value.to(device, dtype) if value.is_floating_point() else value.to(device)


def dtype_name(dtype: torch.dtype) -> str:
    """``bf16`` for ``torch.bfloat16``: the names this script takes."""
    return next(name for name, d in DTYPES.items() if d == dtype)


def check_one(entry, tp: int, dtype: torch.dtype, device: torch.device) -> dict:
    """Build ``entry`` on ``device`` in ``dtype`` and check it at ``tp``: a row of the results."""
    torch.manual_seed(0)
    model = entry.build().to(device, dtype)
    inputs = tree_map(lambda v: _to(v, device, dtype), entry.inputs(model))
    start = time.perf_counter()
    try:
        report = autotp.check(model, tp, inputs, vocab="split")
    except autotp.AutotpError as e:
        return {"verdict": "refused", "detail": str(e).splitlines()[0][:200]}
    seconds = time.perf_counter() - start
    if report.rounding is not None:  # the wider check agrees: the same function, summed in another order
        verdict = f"exact in {report.widened} (rounding in {dtype_name(dtype)})"
    else:
        verdict = "exact" if report.exact else "MISMATCH"
    return {"verdict": verdict, "max_error": report.max_error, "compared": report.compared,
            "seconds": round(seconds, 2), "detail": str(report).splitlines()[0][:200]}


def main(argv=None) -> None:
    """Check each model at each tp and dtype on the first GPU and print a markdown table."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=",".join(DEFAULT_MODELS))
    p.add_argument("--tp", type=int, nargs="+", default=[2, 4])
    p.add_argument("--dtypes", default="fp32,bf16")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--json", default=None, help="also write every row here")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"torch {torch.__version__} on {name}\n")
    print("| model | dtype | tp | verdict | max error | tensors | seconds |\n|---|---|---|---|---|---|---|")
    rows = []
    for entry in entries(only=set(args.models.split(","))):
        for dtype_name in args.dtypes.split(","):
            for tp in args.tp:
                with quiet():
                    try:
                        row = check_one(entry, tp, DTYPES[dtype_name], device)
                    except Exception as e:  # an autotp bug on this device: report it, go on with the others
                        row = {"verdict": "CRASH", "detail": f"{type(e).__name__}: {str(e)[:200]}"}
                row.update(model=entry.name, dtype=dtype_name, tp=tp, device=name, torch=torch.__version__)
                rows.append(row)
                print(f"| {entry.name} | {dtype_name} | {tp} | {row['verdict']} | {row.get('max_error', '-')} | "
                      f"{row.get('compared', '-')} | {row.get('seconds', '-')} |", flush=True)
                if row["verdict"] in ("CRASH", "refused", "MISMATCH"):
                    print(f"    {row['detail']}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
