"""Plans and region searches dumped for a fixed set of models, to compare two versions of the planner byte for byte.

    python -m bench.plan_identity -o /tmp/before.json          # on the old tree
    python -m bench.plan_identity -o /tmp/after.json           # on the new tree
    cmp /tmp/before.json /tmp/after.json
    python -m bench.plan_identity --no-early -o /tmp/full.json # this tree, every lone try walked to its end

A planning speed-up must leave every plan as it was: this writes, per model and tp/pp, the region search's whole
output (every ``RegionMatch`` and unmatched group with its reason, as ``repr``) and the plan's JSON, or the error
planning raised. The models: DeepSeek-V3 and Llama 3 70B at their real configs (meta), a DeepSeek-V3-shaped model
of 12 layers, the tiny Hugging Face mixtures of experts, the example GPT, the test suite's looped experts and a few
zoo models (tied weights, shared layers, hybrids). ``--only`` picks cases by name (substring).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path


def _hf_config(config: dict):
    """A meta model built from a full-size config (as ``bench.planning_time`` builds them)."""
    from autotp.tools.model_spec import build_model, parse_spec

    folder = Path(tempfile.mkdtemp())
    (folder / "config.json").write_text(json.dumps(config))
    return build_model(parse_spec(f"hf:{folder / 'config.json'}"))


def _spec(text: str):
    from autotp.tools.model_spec import build_model, parse_spec

    return build_model(parse_spec(text))


def _zoo(name: str):
    from devtools.zoo import entries

    (entry,) = entries({name})
    model = entry.build()
    return model, entry.inputs(model)


def _looped():
    import torch

    from tests.moe_workers import LoopedExperts

    return LoopedExperts(), (torch.arange(16).reshape(2, 8) % 64,)


def cases() -> list[tuple[str, object, tuple[tuple[int, int], ...]]]:
    """(name, builder returning a model or (model, inputs), the (tp, pp) pairs to plan)."""
    from bench.planning_time import CONFIGS, DEPTH_STYLES

    big = [(name, (lambda c=CONFIGS[name][0]: _hf_config(c)), ((8, 4),)) for name in ("deepseek-v3", "llama3-70b")]
    small = [(f"hf:{t}", (lambda t=t: _spec(f"hf:{t}")), ((2, 1), (4, 2))) for t in
             ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3", "llama")]
    zoo = [(f"zoo:{n}", (lambda n=n: _zoo(n)), ((2, 1), (4, 1))) for n in
           ("gpt2", "olmoe", "jamba", "granitemoeshared", "albert:mlm", "bert:mlm", "resnet:image", "deepseek_v2",
            "phimoe", "qwen2_moe")]
    return big + [
        ("deepseek widths, 12 layers", lambda: _hf_config(DEPTH_STYLES["deepseek"](12)), ((8, 4), (4, 1))),
        ("example gpt", lambda: _spec("examples/train_gpt.py:build_model"), ((2, 2), (4, 1))),
        ("looped experts", _looped, ((2, 1),)),
    ] + small + zoo


def dump(build, pairs) -> dict:
    """The region search and plan of ``build()``'s model at each (tp, pp), or the error each raised."""
    from autotp.capture import capture_repeated
    from autotp.capture.core.examples import example_inputs_of
    from autotp.options import Options
    from autotp.planning.planner import make_plan

    try:
        built = build()
        model, inputs = built if isinstance(built, tuple) else (built, example_inputs_of(built, None))
        captured = capture_repeated(model, inputs)
    except Exception as e:  # a model that does not build or capture: its error is the result to compare
        return {"error": f"{type(e).__name__}: {e}"}
    out = {}
    for tp, pp in pairs:
        key = f"tp={tp} pp={pp}"
        try:
            search = captured.analysis.regions(tp)
            plan = make_plan(captured, Options(tp=tp, pp=pp))
            out[key] = {"regions": [repr(r) for r in search.regions], "unmatched": [repr(u) for u in search.unmatched],
                        "plan": plan.to_dict()}
        except Exception as e:
            out[key] = {"error": f"{type(e).__name__}: {e}"}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-o", "--output", required=True, help="where to write the JSON")
    p.add_argument("--only", default="", help="comma-separated substrings of the case names to run")
    p.add_argument("--no-early", action="store_true",
                   help="judge no lone column try early (passes/dead_ends.py): the search as it was before them")
    args = p.parse_args(argv)
    if args.no_early:
        import autotp.passes.regions  # noqa: F401  (the module; ``autotp.passes`` re-exports a function of its name)

        sys.modules["autotp.passes.regions"].RegionFinder._dead_end = lambda self, proj: False
    wanted = [w for w in args.only.split(",") if w]
    results = {}
    for name, build, pairs in cases():
        if wanted and not any(w in name for w in wanted):
            continue
        results[name] = dump(build, pairs)
        print(name, "error" if "error" in results[name] else "ok", flush=True)
    Path(args.output).write_text(json.dumps(results, indent=1, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
