"""Process-wide switches of torch's tracer set while capturing: its loggers, stack traces, tensor metadata, lazy
code generation, and Python's cycle collector. Each holds ``CAPTURE_LOCK`` while set and is put back after."""

from __future__ import annotations

import gc
import logging

import torch

from autotp.torch_private.entries import EVERY_RELEASE, fenced
from autotp.torch_private.replacements import locked


@fenced("the 'torch' logger and every 'torch.*' logger, disabled ('torch' gets a level)", EVERY_RELEASE,
        replaces=True)
@locked
def quiet_torch_logs():
    """Silence torch's own loggers while captures are tried: a failure is reported by autotp, once.

    Only loggers named ``torch...`` are touched, and restored afterwards; the user's loggers, the root
    logger and stderr are left alone. Each is disabled rather than given a level (``setLevel`` clears every
    logger's cache, once per logger, hundreds of times a capture); ``torch`` alone gets a level, which the loggers
    torch makes while it traces (modules it imports then) inherit.
    """
    names = [n for n in list(logging.root.manager.loggerDict) if n == "torch" or n.startswith("torch.")]
    loggers = [logging.getLogger(n) for n in names]
    previous = [lg.disabled for lg in loggers]
    torch_logger = logging.getLogger("torch")
    level = torch_logger.level
    torch_logger.setLevel(logging.CRITICAL + 1)
    for lg in loggers:
        lg.disabled = True
    try:
        yield
    finally:
        for lg, disabled in zip(loggers, previous):
            lg.disabled = disabled
        torch_logger.setLevel(level)


@fenced("torch.fx.config.do_not_emit_stack_traces, a process-wide tracing flag", replaces=True)
@locked
def no_stack_traces():
    """Tracing without a Python stack trace per node: torch formats one for every node it creates, reading the
    source line of each of some 90 frames (a seventh of a Swin's capture), and the main capture reads none.
    (The fallback capture keeps them: it names the model's source line of a branch taken.)"""
    import torch.fx.config as tracing_config

    before = tracing_config.do_not_emit_stack_traces
    tracing_config.do_not_emit_stack_traces = True
    try:
        yield
    finally:
        tracing_config.do_not_emit_stack_traces = before


@fenced("torch.fx.experimental.proxy_tensor._extract_tensor_metadata, replaced; its include_contiguity argument",
        replaces=True)
@locked
def no_symbolic_layout_probes():
    """Tracing without asking, for every node's output, which of three memory formats its symbolic layout is
    contiguous in. torch stores the answer in ``node.meta["tensor_meta"]`` for passes that rebuild a tensor from
    it when the node has no fake value, which export's never lacks; each answer is sympy over the strides (6% of a
    DeBERTa's capture). autotp reads fake values, never ``tensor_meta``."""
    from torch.fx.experimental import proxy_tensor

    torchs = proxy_tensor._extract_tensor_metadata

    def without_symbolic_layouts(value: torch.Tensor):
        symbolic = any(isinstance(d, torch.SymInt) for d in value.shape)
        return torchs(value, include_contiguity=not symbolic)

    proxy_tensor._extract_tensor_metadata = without_symbolic_layouts
    try:
        yield
    finally:
        proxy_tensor._extract_tensor_metadata = torchs


@fenced("torch.fx._lazy_graph_module._use_lazy_graph_module, the compiler's process-wide switch", replaces=True)
@locked
def lazy_recompiles():
    """Tracing where a graph module made by the trace regenerates its Python code only when it is run or its code
    read: torch.export's passes edit the traced graph and regenerate its code after each, and none of those is
    run (five of a capture's ten regenerations; 0.2 to 0.4 s of a tiny Swin's 2 s). torch's own switch, which
    its compiler sets."""
    from torch.fx._lazy_graph_module import _use_lazy_graph_module

    with _use_lazy_graph_module(True):
        yield


@fenced("Python's cycle collector (gc.disable), process-wide; nothing of torch", replaces=True)
@locked
def no_cycle_collection():
    """Tracing with Python's cycle collector paused (as it was, after). A trace makes many objects that outlive
    it (sympy expressions, graph nodes); each full collection it triggers walks the whole heap (the model, torch,
    transformers) to free little: one took 0.22 s of a DeBERTa's 2 s capture. Reference counting still frees
    what is not in a cycle, and the cycles made meanwhile are collected at the next collection after."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
