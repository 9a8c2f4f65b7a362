"""A user's ``loss_fn`` run inside the rank graph: the model and the loss captured together on first use.

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

from torch import fx, nn

from autotp.errors import CaptureError, InputError, PlanError
from autotp.rewrite.dtypes import cast_for_policy

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
