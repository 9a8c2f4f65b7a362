"""The switch that captures with no speed-up: the ``capture_speedups`` option, else ``AUTOTP_CAPTURE_SPEEDUPS``.

The speed-ups it turns off (shape-only kernels, the tracing switches, draft export's expression tracing silenced,
block stamping) give the graph the plain capture gives, node for node, but each reaches into torch's internals
(``autotp.torch_private``), and a new torch release can break one. Turned off, a capture traces as torch alone
would (slower), so the model still captures, to the same graph and plan, until the speed-up is mended.
``computed_once`` is kept: it decides the graph's form (a value computed again is one node), so the plan's costs
depend on it; it replaces nothing of torch's (a ``TorchFunctionMode``, public).
"""

from __future__ import annotations

import contextlib
import os

from autotp.capture.speedups.shape_kernels import shape_only_kernels
from autotp.torch_private import lazy_recompiles, no_cycle_collection, no_stack_traces, no_symbolic_layout_probes
from autotp.errors import InputError

ENVIRONMENT = "AUTOTP_CAPTURE_SPEEDUPS"
"""The environment variable read when the ``capture_speedups`` option is not set."""

_OFF, _ON = ("0", "false", "no", "off"), ("", "1", "true", "yes", "on")


def speedups_enabled(setting: bool | None = None) -> bool:
    """Whether a capture uses its speed-ups: ``setting`` when given (the ``capture_speedups`` option), else the
    ``AUTOTP_CAPTURE_SPEEDUPS`` environment variable (unset: on). A value of neither kind is refused."""
    if setting is not None:
        return bool(setting)
    value = os.environ.get(ENVIRONMENT, "").strip().lower()
    if value not in _OFF + _ON:
        raise InputError(f"{ENVIRONMENT}={os.environ[ENVIRONMENT]!r} is neither on nor off; set it to 0 to capture "
                         "without speed-ups, 1 (or leave it unset) to capture with them")
    return value not in _OFF


@contextlib.contextmanager
def tracing_speedups(enabled: bool):
    """The speed-ups one torch.export trace runs under (shape-only kernels, no stack traces, no symbolic layout
    probes, the cycle collector paused, lazy recompiles); with ``enabled`` False, none."""
    with contextlib.ExitStack() as stack:
        if enabled:
            for speedup in (shape_only_kernels, no_stack_traces, no_symbolic_layout_probes, no_cycle_collection,
                            lazy_recompiles):
                stack.enter_context(speedup())
        yield
