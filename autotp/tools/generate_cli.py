"""``autotp generate MODEL --tp N``: generate with a tensor-parallel model under torchrun, printing tokens/s.

MODEL is a spec as for ``autotp plan``. A Hugging Face directory holding weights (``hf:path/to/dir``) is loaded
with each rank reading its own slices (the model never exists whole); any other spec is built with seeded random
weights. Prompts are token ids (``--ids 1,2,3``) or, when the directory has a tokenizer, text (``--text``).
"""

from __future__ import annotations

import time
from pathlib import Path

from autotp.errors import InputError


def add_parser(sub) -> None:
    """The ``generate`` subcommand's arguments."""
    p = sub.add_parser("generate", help="generate tokens with the tensor-parallel model (under torchrun), printing "
                                        "tokens/s")
    p.add_argument("model", metavar="MODEL", help="file.py:factory, module:factory, hf:<type> or hf:<directory>")
    p.add_argument("--tp", type=int, required=True, help="tensor-parallel ranks (torchrun's --nproc-per-node)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="NAME=VALUE",
                   help="override a config field or factory argument")
    p.add_argument("--ids", help="the prompt's token ids, comma-separated (default: 8 seeded random ids)")
    p.add_argument("--text", help="the prompt as text (needs a tokenizer in the hf:<directory>)")
    p.add_argument("--batch", type=int, default=1, help="copies of the prompt generated together (default 1)")
    p.add_argument("--max-new-tokens", type=int, default=32, help="new tokens per sequence (default 32)")
    p.add_argument("--do-sample", action="store_true", help="sample instead of greedy decoding")
    p.add_argument("--temperature", type=float)
    p.add_argument("--top-k", type=int)
    p.add_argument("--top-p", type=float)
    p.add_argument("--seed", type=int, default=0, help="sampling seed (pm.manual_seed)")


def _directory(spec) -> Path | None:
    """The Hugging Face directory with weights a spec names, or None."""
    from autotp.tools.model_spec import SpecKind

    path = Path(spec.target)
    if spec.kind is SpecKind.HF_CONFIG and path.is_dir() and any(path.glob("*.safetensors")):
        return path
    return None


def _prompt(args, model, folder: Path | None):
    """The prompt ids ``[batch, length]`` and the tokenizer (None without text)."""
    import torch

    tokenizer = None
    if args.text is not None:
        if folder is None:
            raise InputError("--text needs a tokenizer: give an hf:<directory> holding one, or pass --ids")
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(folder)
        ids = tokenizer(args.text, return_tensors="pt")["input_ids"]
    elif args.ids:
        try:
            ids = torch.tensor([[int(x) for x in args.ids.split(",")]])
        except ValueError as e:
            raise InputError(f"--ids must be comma-separated integers, got {args.ids!r}") from e
    else:
        from autotp.tools.model_spec import example_inputs

        ids = example_inputs(model)[0][:1, :8].to("cpu")
    return ids.expand(args.batch, -1).contiguous(), tokenizer


def run_generate(args) -> int:
    """Build, parallelise and generate; rank 0 prints the tokens (and text) and the speed."""
    import autotp
    from autotp.tools.model_spec import build_model, parse_overrides, parse_spec

    if args.batch < 1 or args.max_new_tokens < 1 or args.tp < 1:
        raise InputError("--tp, --batch and --max-new-tokens must be positive integers")
    spec = parse_spec(args.model, parse_overrides(args.overrides))
    folder = _directory(spec)
    model = build_model(spec, weights=folder is None)
    ids, tokenizer = _prompt(args, model, folder)
    pm = autotp.parallelize(model, tp=args.tp, example_inputs=(ids,), checkpoint=folder, quiet=True)
    pm.manual_seed(args.seed)
    options = {"max_new_tokens": args.max_new_tokens, "do_sample": args.do_sample, "temperature": args.temperature,
               "top_k": args.top_k, "top_p": args.top_p}
    pm.generate(ids, **options | {"max_new_tokens": 1})  # the first call captures the generation steps
    start = time.perf_counter()
    out = pm.generate(ids, **options)
    seconds = time.perf_counter() - start
    if pm.rank == 0:
        new = out[:, ids.shape[1]:]
        for row in new.tolist():
            print(" ".join(map(str, row)))
            if tokenizer is not None:
                print(tokenizer.decode(row))
        how = "the KV cache split over the ranks" if not pm.generation.no_cache else "re-running (no KV cache)"
        print(f"{new.numel()} tokens in {seconds:.2f} s: {new.numel() / seconds:.1f} tokens/s at tp={args.tp}, "
              f"batch {args.batch}, with {how}")
    return 0

