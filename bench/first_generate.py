"""What the first ``pm.generate`` costs, and what ``parallelize`` costs a training user, each in a fresh process.

    python -m bench.first_generate [--rounds 3]

The small Llama of the generation tests (2 layers, hidden 64, 4 query and 2 KV heads, vocabulary 128) at tp=1
(one process: a rank's capture costs the same at any tp). Two kinds of process take turns, each started afresh
so that no capture is warm:

- ``generate``: the model in eval mode (as ``from_pretrained`` returns it), ``parallelize`` on token ids, then
  ``pm.generate`` three times (10 new tokens, a batch of 3) and ``model.generate`` once, the tokens compared;
- ``train``: the model in train mode (as a training script holds it), ``parallelize`` only.

Seconds are wall time and the process's CPU time (steadier on shared cores); medians over the rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def _timed(run) -> tuple[dict, object]:
    wall, cpu = time.perf_counter(), time.process_time()
    out = run()
    return {"wall_s": time.perf_counter() - wall, "cpu_s": time.process_time() - cpu}, out


def one(kind: str) -> dict:
    """The seconds of one ``kind`` process (``generate`` or ``train``)."""
    import torch

    import autotp
    from tests.generation_workers import _prompts, _small

    torch.set_num_threads(1)
    model = _small("llama", 2)
    model.train(kind == "train")
    ids, mask = _prompts()
    found = {}
    found["parallelize"], pm = _timed(lambda: autotp.parallelize(model, tp=1, example_inputs=(ids,), quiet=True))
    if kind == "train":
        return found
    for name in ("first_generate", "second_generate", "third_generate"):
        found[name], out = _timed(lambda: pm.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False))
    found["transformers_generate"], ref = _timed(
        lambda: model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False))
    found["same_tokens"] = bool(torch.equal(out, ref))
    return found


def measure(rounds: int) -> dict:
    """Medians of ``rounds`` fresh processes of each kind, taking turns."""
    runs = {"generate": [], "train": []}
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    for _ in range(rounds):
        for kind in runs:
            done = subprocess.run([sys.executable, "-m", "bench.first_generate", "--one", kind], env=env,
                                  capture_output=True, text=True, check=True)
            runs[kind].append(json.loads(done.stdout.strip().splitlines()[-1]))
    out = {}
    for kind, found in runs.items():
        for key in found[0]:
            if key == "same_tokens":
                out[f"{kind}.same_tokens"] = all(f[key] for f in found)
                continue
            for unit in ("wall_s", "cpu_s"):
                out[f"{kind}.{key}.{unit}"] = round(statistics.median(f[key][unit] for f in found), 3)
    return out


def main(argv=None) -> int:
    """Print the medians as JSON (or, with ``--one``, one process's seconds)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--one", choices=("generate", "train"))
    args = parser.parse_args(argv)
    print(json.dumps(one(args.one) if args.one else measure(args.rounds), indent=None if args.one else 1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
