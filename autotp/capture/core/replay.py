"""The captured graph run once on the example inputs and compared with the model's own forward.

torch.export records what the forward does *while it is traced*, and some forwards branch on exactly that:
transformers drops an attention mask it finds redundant when run eagerly (``_ignore_causal_mask_sdpa`` skips it
unless ``torch.compiler.is_exporting()``) and builds it when traced. Where the attention module is not causal by
itself (``is_causal=False``, a bidirectional text config under a vision-language model), the eager forward then
attends both ways and the graph causally: two different functions, and every rank module built from the graph
would agree with the graph, not with the model. One replay on the example finds it before anything is planned.

A forward that applies custom autograd Functions is replayed with gradients too, in training mode: the graph holds
their forwards only and training differentiates those, which equals the Function's own backward only when that
backward is the derivative of its forward. YOSO's ``YosoCumulation`` is not (its backward is the expectation's
approximation): the gradients of the model and of the graph differ, so such a capture is refused.

A model on the meta device has no values to run; it is not replayed.
"""

from __future__ import annotations

import contextlib

import torch
from torch import fx, nn
from autotp.torch_private.pytree import tree_leaves

from autotp.capture.quirks.weight_writes import written_parameters
from autotp.errors import AutotpError, CaptureError, InputError

SEED = 0
"""Both runs draw from torch's generator seeded alike (dropout in a train-mode capture), restored afterwards."""

TOLERANCE = {torch.float64: 1e-6, torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 2e-2}
"""The largest difference, relative to the output's largest element, that the same ops run in another order or
by another kernel may make; a different function differs by far more (PaliGemma's skipped mask: 0.08)."""


INFERENCE_ONLY = ("Train this model unsplit, or plan it for inference only, with the model in eval mode "
                  "(autotp.plan(model.eval(), tp))")
"""What a model whose gradients the graph cannot give may still do."""


def check_replay(gm: fx.GraphModule, run_model, inputs: tuple, model: nn.Module) -> None:
    """Raise ``CaptureError`` when ``gm`` on ``inputs`` differs from ``run_model(*inputs)`` (the model's own
    forward, called as the capture called it). Buffers a train-mode forward updates (batch-norm statistics) are
    restored, and the random generator too, so the model is left as it was."""
    if _on_meta(model, inputs):
        return
    devices = _cuda_devices(inputs)
    with torch.no_grad(), _buffers_restored(model, gm), _tensor_attributes_restored(model), \
            torch.random.fork_rng(devices=devices):
        torch.manual_seed(SEED)
        want = _own_forward(run_model, inputs, model)
        torch.manual_seed(SEED)
        got = gm(*inputs)
    pairs = [(g, w) for g, w in zip(tree_leaves(got), tree_leaves(want))
             if isinstance(w, torch.Tensor) and isinstance(g, torch.Tensor) and w.is_floating_point()]
    for i, (g, w) in enumerate(pairs):
        error = _relative_error(g, w)
        if error > TOLERANCE.get(w.dtype, 1e-4):
            raise CaptureError(_message(type(model).__name__, i, w, error))


def _own_forward(run_model, inputs: tuple, model: nn.Module):
    """``run_model(*inputs)``; the model's own failure on them (tracing on fake tensors checks no values: token ids
    past the embedding's rows trace, and fail here) is the inputs' fault, said as an ``InputError``."""
    try:
        return run_model(*inputs)
    except (AutotpError, TimeoutError):  # ours, or a caller's time limit
        raise
    except Exception as e:  # the user's forward: any type
        raise InputError(f"{type(model).__name__}'s own forward fails on the example inputs: {type(e).__name__}: "
                         f"{str(e).splitlines()[0] if str(e) else ''}; pass inputs it accepts (token ids below its "
                         "vocabulary: on the command line, --vocab-size at most the model's)") from e


def check_gradient_replay(gm: fx.GraphModule, run_model, inputs: tuple, model: nn.Module, functions: set[str],
                          names: dict[str, str]) -> None:
    """Raise ``CaptureError`` when, for a train-mode forward that applied the custom autograd ``functions``, the
    parameters' gradients through ``gm`` differ from those of the model's own backward on ``inputs`` (of a seeded
    random projection of the outputs). ``names`` maps ``gm``'s parameter names to the model's. Nothing the model
    holds changes (buffers, ``.grad``, the random generator)."""
    if not functions or _on_meta(model, inputs):
        return
    mine = {names.get(n, n): p for n, p in gm.named_parameters() if p.requires_grad}
    theirs = {n: p for n, p in model.named_parameters() if p.requires_grad and n in mine}
    if not theirs:
        return
    devices = _cuda_devices(inputs)
    with torch.enable_grad(), _buffers_restored(model, gm), _tensor_attributes_restored(model), \
            torch.random.fork_rng(devices=devices):
        torch.manual_seed(SEED)
        want = _gradients(run_model(*inputs), theirs)
        torch.manual_seed(SEED)
        try:
            got = _gradients(gm(*inputs), {n: mine[n] for n in theirs})
        except RuntimeError as e:  # autograd through the traced forward fails where the Function's backward did not
            raise CaptureError(
                f"cannot capture {type(model).__name__} for training: its forward applies custom autograd "
                f"Function(s) {', '.join(sorted(functions))}, and autograd through their traced forwards fails "
                f"where their own backward does not ({(str(e).strip().splitlines() or [''])[0][:200]}; a forward "
                "that writes in place a value its ops save for backward, as a softmax masked in place). "
                f"torch.export captures forwards only. {INFERENCE_ONLY}") from e
    for name, w in want.items():
        g = got[name]
        if w is None or g is None:
            continue
        error = _relative_error(g, w)
        if error > TOLERANCE.get(w.dtype, 1e-4):
            raise CaptureError(
                f"cannot capture {type(model).__name__} for training: its forward applies custom autograd "
                f"Function(s) {', '.join(sorted(functions))} whose backward is not the derivative of its forward: "
                f"on the example inputs the gradient of {name} (sizes {list(w.shape)}) differs by {error:.3g} of "
                "its largest element between the model's own backward and autograd through the traced forward. "
                "torch.export captures forwards only, so a split model would train with other gradients than the "
                f"model. {INFERENCE_ONLY}")


def _gradients(outputs, params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor | None]:
    """The gradients of ``params`` of a seeded random projection of every floating output (a plain sum can be
    constant, as softmax's is)."""
    leaves = [o for o in tree_leaves(outputs) if isinstance(o, torch.Tensor) and o.is_floating_point()
              and o.requires_grad]
    if not leaves:
        return dict.fromkeys(params)
    weights = torch.Generator().manual_seed(SEED)
    loss = sum((o * torch.randn(o.shape, generator=weights).to(o)).sum() for o in leaves)
    found = torch.autograd.grad(loss, list(params.values()), allow_unused=True)
    return dict(zip(params, found))


def _cuda_devices(inputs: tuple) -> list[int]:
    """The GPUs the inputs are on: their generators are restored too (dropout on a GPU draws from its own)."""
    return sorted({x.device.index or 0 for x in inputs if isinstance(x, torch.Tensor) and x.is_cuda})


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
def _tensor_attributes_restored(model: nn.Module):
    """Every plain tensor attribute of ``model``'s modules as it was before the body, none added: a forward may
    keep a state (RecurrentGemma's ``rg_lru.recurrent_states``), which one run with gradients would leave
    holding the autograd graph, and a model holding a non-leaf tensor cannot be deep-copied (the checker does)."""
    saved = [(module, {k: v for k, v in vars(module).items() if isinstance(v, torch.Tensor)})
             for module in model.modules()]
    try:
        yield
    finally:
        for module, tensors in saved:
            for name in [k for k, v in vars(module).items() if isinstance(v, torch.Tensor) and k not in tensors]:
                delattr(module, name)
            for name, value in tensors.items():
                setattr(module, name, value)


@contextlib.contextmanager
def _buffers_restored(*modules: nn.Module):
    """Every buffer of ``modules`` as it was before the body (a train-mode forward updates running statistics),
    and every parameter a graph among them writes in place (its model's forward does too, outside autograd)."""
    saved = {}
    for module in modules:
        for buffer in module.buffers():
            saved.setdefault(id(buffer), (buffer, buffer.detach().clone()))
        for parameter in written_parameters(module) if isinstance(module, fx.GraphModule) else ():
            saved.setdefault(id(parameter), (parameter, parameter.detach().clone()))
    try:
        yield
    finally:
        with torch.no_grad():
            for buffer, value in saved.values():
                buffer.copy_(value)
