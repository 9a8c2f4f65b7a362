"""Collectives of the one-process checker counted at run time, forward and backward apart (the LoRA tests')."""

from __future__ import annotations

import autotp
from autotp.checker import Prepared, check_prepared

_COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_reduce_started", "all_gather_started",
                "all_to_all", "ring_shift_started")


def _counting(modules, comms, log: list) -> None:
    """Record rank 0's collectives in ``log`` as (phase, collective, shape): the phase is ``forward`` while its
    module's forward runs, ``backward`` after (a collective in an autograd Function's forward runs without grad
    mode, so grad mode cannot tell them apart)."""
    phase = ["forward"]

    def forward(*args, _run=modules[0].forward, **kwargs):
        phase[0] = "forward"
        out = _run(*args, **kwargs)
        phase[0] = "backward"
        return out

    modules[0].forward = forward
    comm = comms[0]
    for name in _COLLECTIVES:
        run = getattr(comm, name)

        def counted(x, *args, _run=run, _name=name, **kwargs):
            shape = tuple(x.shape) if hasattr(x, "shape") else tuple(x[0].shape)
            log.append((phase[0], _name.removesuffix("_started"), shape))
            return _run(x, *args, **kwargs)

        setattr(comm, name, counted)


def checked(model, tp: int, inputs, **settings) -> tuple[autotp.CheckReport, list, list]:
    """``autotp.check`` of ``model`` at ``tp``, and the (collective, shape) of each collective rank 0 ran in the
    forward and in the backward. ``model`` may be a ``checker.prepare``d capture (``inputs`` then unused), to check
    one capture at several settings."""
    log: list = []
    hook = lambda m, c: _counting(m, c, log)  # noqa: E731
    if isinstance(model, Prepared):
        report = check_prepared(model, tp, modules_hook=hook, **settings)
    else:
        report = autotp.check(model, tp=tp, example_inputs=inputs, modules_hook=hook, **settings)
    return report, [e[1:] for e in log if e[0] == "forward"], [e[1:] for e in log if e[0] == "backward"]
