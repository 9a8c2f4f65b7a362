"""Activation recompute: each block of a rank graph (or pipeline stage) run under ``torch.utils.checkpoint``.

Blocks are the runs between the pipeline cut candidates (``passes.cuts.find_cuts``): where the graph narrows
to one hidden state, so a block keeps only its inputs for backward and recomputes the rest. Names play no
part. Each block's nodes move into a submodule called through ``Recomputed``; parameters stay ``get_attr``
nodes of the rank graph, passed in as inputs, so a rank module's parameters, state dict and FSDP units do
not change. The model's last block (the head and the output gathers the runtime defers) is left as it is.

Exact with dropout: a recomputed block draws from the rank's stream as it stood before the block's first
forward (``RankStream.replaying``), so its masks are the first forward's, and the stream then goes on where
that forward left it (other microbatches' forwards may run between a block's forward and its backward).
"""

from __future__ import annotations

import operator

from torch import fx, nn
from torch.utils.checkpoint import checkpoint

from autotp.passes.analysis import Analysis
from autotp.passes.cuts import find_cuts
from autotp.passes.graph import grad_nodes
from autotp.rewrite.stage_graphs import unit_of_nodes
from autotp.rewrite.streams import RankStream

PREFIX = "autotp_recompute_"


class Recomputed(nn.Module):
    """A block whose activations are not kept: ``block`` runs again in backward, drawing the same masks."""

    def __init__(self, block: fx.GraphModule, stream: RankStream | None):
        super().__init__()
        self.block, self.stream = block, stream
        self.mutated = _mutated_inputs(block)

    def forward(self, *inputs):
        snapshot = self.stream.snapshot() if self.stream is not None else None
        calls = []

        def run(*args):
            # An input the block writes in place (a MoE router's index buffer, made by ``empty_like`` in the
            # block before and filled by ``index_put_`` in this one) is copied first: checkpoint keeps the
            # original for the recompute, which must find it as the first forward did.
            args = tuple(a.clone() if i in self.mutated else a for i, a in enumerate(args))
            calls.append(None)
            if len(calls) == 1 or self.stream is None:
                return self.block(*args)  # the first forward draws from the stream and moves it on
            with self.stream.replaying(snapshot):
                return self.block(*args)

        # Non-reentrant: gradients reach parameters passed as inputs, and a block may return non-tensors.
        # With a stream, the stream replays the masks: checkpoint must then leave torch's process-wide generator
        # alone, because its restore of that state (unlocked) races the stream's swaps when the checker runs
        # ranks as threads (measured: a wrong embedding gradient, 1.8e-3, in one full-suite run).
        return checkpoint(run, *inputs, use_reentrant=False, preserve_rng_state=self.stream is None)


def _mutated_inputs(block: fx.GraphModule) -> frozenset[int]:
    """Positions of ``block``'s inputs that an in-place op (``index_put_``, ``div_``: an overload whose name
    ends in ``_``) writes."""
    inputs = [n for n in block.graph.nodes if n.op == "placeholder"]
    written = set()
    for node in block.graph.nodes:
        name = getattr(getattr(node.target, "overloadpacket", None), "__name__", "")
        if node.op == "call_function" and name.endswith("_") and not name.startswith("_") and node.args:
            written.add(node.args[0])
    return frozenset(i for i, n in enumerate(inputs) if n in written)


def _runs(gm: fx.GraphModule, unit_of: dict[str, int], grad: set[str], last: int) -> list[list[fx.Node]]:
    """Maximal runs of consecutive computing nodes in one unit that carry gradients (recomputing values made
    from inputs only saves nothing), the model's last unit excepted."""
    runs: list[list[fx.Node]] = []
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "get_attr", "output"):
            continue  # parameters and inputs stay in the rank graph and do not end a run
        if runs and unit_of[runs[-1][-1].name] == unit_of[node.name]:
            runs[-1].append(node)
        else:
            runs.append([node])
    return [r for r in runs if unit_of[r[0].name] != last and any(n.name in grad for n in r)]


def _extract(gm: fx.GraphModule, run: list[fx.Node]) -> tuple[fx.GraphModule, list[fx.Node], list[fx.Node]]:
    """The run as a GraphModule of its own, the rank-graph values it reads and those read after it."""
    inside = set(run)
    inputs = list(dict.fromkeys(a for n in run for a in n.all_input_nodes if a not in inside))
    outputs = [n for n in run if any(u not in inside for u in n.users)]
    graph, env = fx.Graph(), {}
    for value in inputs:
        env[value] = graph.placeholder(value.name)
        env[value].meta = dict(value.meta)
    for node in run:
        env[node] = graph.node_copy(node, env.__getitem__)
    graph.output(tuple(env[o] for o in outputs))
    graph.lint()
    return fx.GraphModule(gm, graph, class_name="AutotpBlock"), inputs, outputs


def _replace(gm: fx.GraphModule, run: list[fx.Node], name: str, stream: RankStream | None) -> None:
    block, inputs, outputs = _extract(gm, run)
    gm.add_submodule(name, Recomputed(block, stream))
    with gm.graph.inserting_after(run[-1]):
        call = gm.graph.call_module(name, tuple(inputs))
    with gm.graph.inserting_after(call):
        for index, value in reversed(list(enumerate(outputs))):
            item = gm.graph.call_function(operator.getitem, (call, index))
            item.meta = dict(value.meta)
            value.replace_all_uses_with(item)
    for node in reversed(run):
        gm.graph.erase_node(node)


def recompute_blocks(gm: fx.GraphModule, analysis: Analysis, stream: RankStream | None) -> int:
    """Make every block of ``gm`` (a rank graph or a pipeline stage of the capture ``analysis`` describes)
    recompute its activations in backward; returns how many blocks. Edits ``gm`` in place."""
    cuts = find_cuts(analysis.graph, analysis.trainable, analysis.grad)
    position = {n.name: i for i, n in enumerate(analysis.graph.nodes)}
    unit_of = unit_of_nodes(gm, position, cuts)
    runs = _runs(gm, unit_of, grad_nodes(gm.graph, analysis.trainable), len(cuts))
    for index, run in enumerate(runs):
        _replace(gm, run, f"{PREFIX}{index}", stream)
    gm.graph.lint()
    gm.recompile()
    return len(runs)
