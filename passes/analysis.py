"""The passes' results for one captured model, read-only, shared by the planner and the rewriter.

``Analysis`` runs the structural passes once (projections, embeddings, the vocabulary) and answers
questions about them by name. It takes any captured model that offers the few attributes of
``CapturedModel`` (``autotp.capture.Captured`` does), so the passes do not depend on capture.
"""

from __future__ import annotations

import functools

from collections.abc import Mapping
from typing import Protocol

import sympy
from torch import fx

from autotp.passes.choices import kept_by_choice
from autotp.passes.graph import sizes, trainable_attrs
from autotp.passes.layout import Shard
from autotp.passes.projections import find_embeddings, find_projections
from autotp.passes.propagate import Propagation, propagate
from autotp.passes.regions import RegionSearch, find_regions
from autotp.passes.vocab import VocabMatch, find_vocab


class CapturedModel(Protocol):
    """What the passes need of a captured model."""

    module: fx.GraphModule
    model_name: str

    def module_name(self, node: fx.Node) -> str:
        """The original module a node was traced in ('' for the top level)."""

    def param_name(self, target: str) -> str:
        """The original parameter name of a ``get_attr`` target."""


class Analysis:
    """The passes' results for one captured model (read-only)."""

    def __init__(self, captured: CapturedModel):
        self.captured = captured
        self.graph = captured.module.graph
        self.nodes = {n.name: n for n in self.graph.nodes}
        self.projections = find_projections(self.graph)
        self.embeddings = find_embeddings(self.graph)
        self.trainable = trainable_attrs(captured.module)
        self.vocab: VocabMatch | None = find_vocab(self.graph, self.projections, self.embeddings)

    def module(self, node_name: str) -> str:
        """The original module name of a node."""
        return self.captured.module_name(self.nodes[node_name])

    def layer(self, node_name: str) -> str:
        """A readable name for a projection or embedding: its module (``attn.c_attn``), or its parameter
        when the module holds bare parameters (``blocks.0.w_qkv``)."""
        found = self.projections.get(node_name) or self.embeddings.get(node_name)
        module = self.module(node_name)
        if found is None:
            return module or node_name
        param = self.captured.param_name(found.weight)
        parent, _, short = param.rpartition(".")
        bare = short != "weight" and parent == module
        return param if bare or not module else module

    def regions(self, tp: int) -> RegionSearch:
        """Column→row regions for ``tp`` (LM heads are planned separately)."""
        skip = set(self.vocab.heads) if self.vocab else set()
        return find_regions(self.graph, self.projections, self.embeddings, self.trainable, tp, skip=skip,
                            whole=set(self.chosen_whole))

    @functools.cached_property
    def chosen_whole(self) -> dict[str, str]:
        """Projections kept whole on purpose (``choices.kept_by_choice``), with why (found once, read by the
        region search and the planner)."""
        heads = self.vocab.heads if self.vocab else ()
        found = {n: kept_by_choice(self.nodes[n], self.projections, heads) for n in self.projections}
        return {n: why for n, why in found.items() if why}

    def propagate(self, layouts: Mapping[str, Shard], tp: int, sequence_parallel: bool = False,
                  inputs: Mapping[str, Shard] | None = None) -> Propagation:
        """Propagate parameter layouts (keyed by ``get_attr`` target) through the whole graph, with the residual
        stream split along the sequence when ``sequence_parallel``; ``inputs``: placeholders given split."""
        sequence = self.sequence_sizes if sequence_parallel else frozenset()
        return propagate(self.graph, self.projections, self.embeddings, layouts, tp, self.trainable, sequence=sequence,
                         inputs=inputs)

    @functools.cached_property
    def sequence_sizes(self) -> frozenset:
        """The sequence lengths: the dynamic last dim of the ids every embedding looks up (token and position ids)."""
        found = (sympy.sympify(sizes(self.nodes[e.ids])[-1]) for e in self.embeddings.values()
                 if sizes(self.nodes[e.ids]))
        return frozenset(s for s in found if not s.is_Integer)

    def param_size(self, target: str, dim: int) -> int:
        """Size of dim ``dim`` of the parameter read by ``get_attr`` target ``target``."""
        node = next(n for n in self.graph.find_nodes(op="get_attr") if n.target == target)
        return int(sizes(node)[dim])
