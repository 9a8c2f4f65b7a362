"""The captured graph run once on the example inputs and compared with the model's own forward.

torch.export records what the forward does *while it is traced*, and some forwards branch on exactly that:
transformers drops an attention mask it finds redundant when run eagerly (``_ignore_causal_mask_sdpa`` skips it
unless ``torch.compiler.is_exporting()``) and builds it when traced. Where the attention module is not causal by
itself (``is_causal=False``, a bidirectional text config under a vision-language model), the eager forward then
attends both ways and the graph causally: two different functions, and every rank module built from the graph
would agree with the graph, not with the model. One replay on the example finds it before anything is planned.

A model on the meta device has no values to run; it is not replayed.
"""

from __future__ import annotations

import contextlib

import torch
from torch import fx, nn
from torch.utils._pytree import tree_leaves

from autotp.errors import CaptureError

SEED = 0
"""Both runs draw from torch's generator seeded alike (dropout in a train-mode capture), restored afterwards."""

TOLERANCE = {torch.float64: 1e-6, torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 2e-2}
"""The largest difference, relative to the output's largest element, that the same ops run in another order or
by another kernel may make; a different function differs by far more (PaliGemma's skipped mask: 0.08)."""


def check_replay(gm: fx.GraphModule, run_model, inputs: tuple, model: nn.Module) -> None:
    """Raise ``CaptureError`` when ``gm`` on ``inputs`` differs from ``run_model(*inputs)`` (the model's own
    forward, called as the capture called it). Buffers a train-mode forward updates (batch-norm statistics) are
    restored, and the random generator too, so the model is left as it was."""
    if _on_meta(model, inputs):
        return
    # the generators of the devices the inputs are on are restored too (dropout on a GPU draws from its own)
    devices = sorted({x.device.index or 0 for x in inputs if isinstance(x, torch.Tensor) and x.is_cuda})
    with torch.no_grad(), _buffers_restored(model, gm), torch.random.fork_rng(devices=devices):
        torch.manual_seed(SEED)
        want = run_model(*inputs)
        torch.manual_seed(SEED)
        got = gm(*inputs)
    pairs = [(g, w) for g, w in zip(tree_leaves(got), tree_leaves(want))
             if isinstance(w, torch.Tensor) and isinstance(g, torch.Tensor) and w.is_floating_point()]
    for i, (g, w) in enumerate(pairs):
        error = _relative_error(g, w)
        if error > TOLERANCE.get(w.dtype, 1e-4):
            raise CaptureError(_message(type(model).__name__, i, w, error))


def _on_meta(model: nn.Module, inputs: tuple) -> bool:
    tensors = [*model.parameters(), *model.buffers(), *[x for x in inputs if isinstance(x, torch.Tensor)]]
    return any(t.is_meta for t in tensors)


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| over the largest |want| (0 for equal tensors, inf for other shapes)."""
    if got.shape != want.shape:
        return float("inf")
    if not want.numel():
        return 0.0
    got, want = got.double(), want.double()
    both_nan = got.isnan() & want.isnan()
    diff = (got - want).abs().masked_fill(both_nan, 0.0)
    finite = want[torch.isfinite(want)]
    scale = float(finite.abs().max()) if finite.numel() else 1.0
    return float(diff.max()) / max(scale, 1e-12)


def _message(model_name: str, index: int, want: torch.Tensor, error: float) -> str:
    return (f"the captured graph of {model_name} computes something else than its forward: on the example inputs "
            f"output {index} (sizes {list(want.shape)}) differs by {error:.3g} of its largest element. The forward "
            "takes another branch when traced than when run: transformers, for one, skips an all-ones attention "
            "mask when run and builds it when traced, which changes the result where the attention module is not "
            "causal by itself. Every rank would follow the graph, so nothing is planned. Pass the inputs the model "
            "is trained with (a padded attention_mask, token_type_ids, ...) so that both take the same branch, or "
            "make the forward independent of torch.compiler.is_compiling()/is_exporting()")


@contextlib.contextmanager
def _buffers_restored(*modules: nn.Module):
    """Every buffer of ``modules`` as it was before the body (a train-mode forward updates running statistics)."""
    saved = {}
    for module in modules:
        for buffer in module.buffers():
            saved.setdefault(id(buffer), (buffer, buffer.detach().clone()))
    try:
        yield
    finally:
        with torch.no_grad():
            for buffer, value in saved.values():
                buffer.copy_(value)
