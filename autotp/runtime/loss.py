"""The loss of a training step, in one place: which loss ``step`` trains on, and a user's ``loss_fn`` run inside
the rank graph.

``step`` trains on the model's own loss (``output.loss``, computed from ``labels`` inside the graph), the default
cross-entropy of the logits against ``target`` (Megatron's vocab-parallel cross-entropy on vocabulary-split logits,
never gathered), or a user's ``loss_fn(output, target)``. An evaluation call of a model captured with labels
returns its output ``without_loss``.

The model and a user's loss are captured together on first use (``LossGraphs``): the capture is
``capture.with_loss``'s and the rank graph ``rewrite.loss_graph``'s, the layers below that build it for this one.

``pm.step(x, target=y, loss_fn=f)`` would otherwise gather every split output for ``f``: the B×T×V logits of a
vocabulary-split head. Captured with the model (``capture.with_loss``, built by the rewrite's
``loss_graph.build_loss_graph``, which ``autotp.api`` hands in), a cross-entropy inside ``f`` runs on the split
logits. Where that cannot be done (``f`` does not trace, the model was freed, FSDP or torch.compile wraps the
graphs, the splits do not carry through ``f``) the step falls back to gathering, and a warning says why, once per
loss function. Every rank decides alike: the capture and the plan are the same on each.

A captured ``loss_fn`` is traced once: Python values it reads are fixed in its graph. The numbers in its closure
and defaults (a z-loss or smoothing coefficient on a schedule) are part of the key a graph is kept under, so a
changed one captures it again rather than run the old value.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable

import torch
from torch import fx, nn

from autotp.errors import CaptureError, InputError, PlanError
from autotp.rewrite.dtypes import cast_for_policy
from autotp.rewrite.collectives import VocabParallelCrossEntropy
from autotp.runtime.outputs import SplitOutputs


def logits_of(output) -> torch.Tensor:
    """The logits of a model's output: ``output.logits`` (Hugging Face), the first of a tuple, or the output."""
    logits = getattr(output, "logits", output)
    if isinstance(logits, dict):
        logits = logits.get("logits")
    if isinstance(logits, (tuple, list)):
        logits = logits[0]
    if not isinstance(logits, torch.Tensor):
        raise InputError(f"the default loss is the cross-entropy of the logits, but the model's output is a "
                         f"{type(output).__name__} with no logits; pass loss_fn=")
    return logits


def default_loss(output, target: torch.Tensor, split: SplitOutputs | None = None) -> torch.Tensor:
    """Cross-entropy of the logits against ``target`` (mean over every token). Logits left split along the
    vocabulary are not gathered: Megatron's vocab-parallel cross-entropy computes the same loss from the
    shards."""
    logits = logits_of(output)
    gather = split.gather_of(logits) if split is not None else None
    if gather is not None and gather.dim == logits.dim() - 1 and len(gather.segments) == 1 and not gather.blocked:
        if target.numel() != logits.shape[:-1].numel():
            raise InputError(f"the default loss takes one target class per logits row: logits of shape "
                             f"{tuple(logits.shape)} need {logits.shape[:-1].numel()} targets, got a target of "
                             f"shape {tuple(target.shape)}")
        # Classes last, in whatever layout the model left them (no B×T×V/tp copy to flatten them).
        loss = VocabParallelCrossEntropy(gather.comm, classes=gather.segments[0], overwrite=gather.overwritable)
        return loss(logits.movedim(-1, 1), target.reshape(logits.shape[:-1]))
    if gather is not None:  # split some other way: made whole for the plain loss
        logits = gather.whole(logits)
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def user_loss(loss_fn: Callable, output, target: torch.Tensor, split: SplitOutputs | None) -> torch.Tensor:
    """``loss_fn`` on the output as the model returns it: every split output gathered first."""
    return loss_fn(split.whole(output) if split is not None else output, target)


def model_loss(output) -> torch.Tensor | None:
    """The loss the model computed itself (a Hugging Face model given ``labels``: ``output.loss``), or None."""
    if isinstance(output, dict):
        return output.get("loss")
    return getattr(output, "loss", None)


def step_loss(output, target: torch.Tensor | None, loss_fn: Callable | None,
              split: SplitOutputs | None = None) -> torch.Tensor:
    """The loss ``step`` trains on: ``loss_fn`` (default: cross-entropy) against ``target`` when given, else the
    model's own (computed from ``labels`` inside the model). ``split``: the outputs the step left split."""
    if target is not None:
        if loss_fn is None:
            return checked_loss(default_loss(output, target, split))
        return checked_loss(user_loss(loss_fn, output, target, split))
    if loss_fn is not None:
        raise InputError("loss_fn is called as loss_fn(output, target), but no target= was given; pass target=")
    loss = model_loss(output)
    if loss is None:
        raise InputError("step needs a loss: pass target= (with the default cross-entropy or your loss_fn), or "
                         "labels= to a model that computes its own loss (a Hugging Face model's output.loss); "
                         "this model's output has no loss")
    return checked_loss(loss)


def checked_loss(loss) -> torch.Tensor:
    """A loss function's result, which must be a scalar tensor with a gradient to follow."""
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        got = f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise InputError(f"loss_fn must return a scalar tensor (e.g. a mean), got {got}; reduce it with .mean() or "
                         ".sum() inside loss_fn")
    if not loss.requires_grad:
        raise InputError("loss_fn returned a tensor with no gradient history (made with .item(), .detach() or "
                         "torch.no_grad?); compute it from the model's output with torch operations")
    return loss


def without_loss(output):
    """``output`` as the model returns it without labels: its ``loss`` entry gone."""
    if isinstance(output, dict):
        kept = {k: v for k, v in output.items() if k != "loss"}
        return type(output)(**kept) if type(output) is not dict else kept
    return output


BuildLossGraph = Callable
"""``rewrite.loss_graph.build_loss_graph(model, plan, rank, comm, stream, tensors, call, loss_fn, training)``."""


class LossGraphs:
    """The rank graphs of the model with each ``loss_fn`` it was stepped with (None: that one gathers)."""

    def __init__(self, model: nn.Module, build: BuildLossGraph):
        self._model = weakref.ref(model)  # the graphs read the parallel module's tensors, not the model's
        self._build = build
        self._graphs: dict[tuple, fx.GraphModule | None] = {}

    def graph(self, pm, loss_fn: Callable, call: tuple, tensors: Callable[[], dict]) -> fx.GraphModule | None:
        """The graph of ``pm``'s model with ``loss_fn`` in ``pm``'s mode, built on first use from ``call`` (input
        names, flat inputs, target) over ``tensors()``; None where it cannot be built (warned once)."""
        key = (loss_fn, pm.training, _scalars(loss_fn))
        if key not in self._graphs:
            self._graphs[key] = self._made(pm, loss_fn, call, tensors)
        return self._graphs[key]

    def _made(self, pm, loss_fn: Callable, call: tuple, tensors: Callable[[], dict]) -> fx.GraphModule | None:
        why = _why_not(pm)
        model = self._model()
        if why is None and model is None:
            why = "the model passed to parallelize has been freed, and the loss is captured with it on first use"
        if why is None:
            try:
                graph = self._build(model, pm.plan, pm.rank, pm.comm, pm._stream, tensors(), call, loss_fn,
                                    pm.training)
                cast_for_policy(graph, pm.options)  # as the model's own graphs: the policy's param_dtype
                return pm.retyped(graph)  # captured in the model's dtype, and pm.to(dtype) may have changed pm's
            except (CaptureError, InputError, PlanError) as e:  # an InternalError is autotp's bug: raised
                why = f"it could not be captured with the model: {e}"
        name = getattr(loss_fn, "__name__", type(loss_fn).__name__)
        warnings.warn(f"loss_fn {name} runs on gathered outputs (the logits all-gathered for it), because {why}",
                      stacklevel=4)
        return None


def _why_not(pm) -> str | None:
    """Why ``pm``'s graphs cannot take a loss graph beside them, or None."""
    if pm.fsdp_unit is not None:
        return "under FSDP the model's graphs run as one unit, which a second graph would bypass"
    if pm._compiled is not None:
        return "the model's graphs are compiled (compile=True)"
    return None


def _scalars(loss_fn: Callable) -> tuple:
    """The Python numbers, strings and flags ``loss_fn`` reads from its closure and defaults (a bound method's
    function's too), which its graph holds as constants."""
    fn = getattr(loss_fn, "__func__", loss_fn)
    cells = [c.cell_contents for c in (getattr(fn, "__closure__", None) or ()) if _filled(c)]
    values = [*cells, *(getattr(fn, "__defaults__", None) or ()), *(getattr(fn, "__kwdefaults__", None) or {}).values()]
    return tuple(v for v in values if isinstance(v, (bool, int, float, str)))


def _filled(cell) -> bool:
    try:
        cell.cell_contents
    except ValueError:  # a cell not yet assigned
        return False
    return True
