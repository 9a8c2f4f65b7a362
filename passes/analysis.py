"""The passes' results for one captured model, read-only, shared by the planner and the rewriter.

``Analysis`` runs the structural passes once (projections, embeddings, the vocabulary), each through
``run_pass`` (one signature: the graph and the results so far in, a result out; a pass that fails is named
with the passes that ran before it), and answers questions about them by name. A captured model holds one
``Analysis`` (``Captured.analysis``), and the propagation of a set of placements is computed once per
analysis (``propagate_placements``): the planner, the rewriter of every rank and the checker share it.
It takes any captured model that offers the few attributes of ``CapturedModel`` (``autotp.capture.Captured``
does), so the passes do not depend on capture.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Protocol

import sympy
from autotp.passes.adapters import Adapter, adapter_adds, adapter_reads, find_adapters
from autotp.passes.embedding_adapters import EmbeddingAdapter, find_embedding_adapters
from autotp.passes.choices import kept_by_choice
from autotp.passes.graph import grad_nodes, sizes, trainable_attrs
from autotp.passes.placement import Placement, PlacementKind, Shard
from autotp.passes.projections import find_embeddings, find_projections
from autotp.passes.propagate import propagate
from autotp.passes.propagation import Propagation
from autotp.passes.region_search import RegionSearch, find_regions
from autotp.passes.uneven_vocab import is_the_vocabulary, uneven_violations, uneven_vocabulary
from autotp.passes.vocab import VocabMatch, find_vocab
from torch import fx


class CapturedModel(Protocol):
    """What the passes need of a captured model."""

    module: fx.GraphModule
    model_name: str

    def module_name(self, node: fx.Node) -> str:
        """The original module a node was traced in ('' for the top level)."""

    def param_name(self, target: str) -> str:
        """The original parameter name of a ``get_attr`` target."""

    def attr_target(self, param_name: str) -> str:
        """The ``get_attr`` target of an original parameter name."""

    aliases: Mapping[str, str]
    """Every tied name -> the name its tensor is read under."""


class PassFailed(RuntimeError):
    """A structural pass raised: names it and the passes that ran before it (an autotp bug, or a graph shape no
    pass expected)."""


def run_pass(name: str, run, done: list[str]):
    """Run pass ``name`` (``run()``: its result), recording it in ``done``; a failure names the pass and the
    passes before it."""
    try:
        result = run()
    except Exception as e:
        before = ", ".join(done) or "none"
        raise PassFailed(f"pass {name!r} failed (passes run before it: {before}): {type(e).__name__}: {e}") from e
    done.append(name)
    return result


class Analysis:
    """The passes' results for one captured model (read-only)."""

    def __init__(self, captured: CapturedModel):
        self.captured = captured
        self.graph = captured.module.graph
        self.nodes = {n.name: n for n in self.graph.nodes}
        self.passes_run: list[str] = []
        self.projections = run_pass("projections", lambda: find_projections(self.graph), self.passes_run)
        self.embeddings = run_pass("embeddings", lambda: find_embeddings(self.graph), self.passes_run)
        self.trainable = run_pass("trainable", lambda: trainable_attrs(captured.module), self.passes_run)
        self.vocab: VocabMatch | None = run_pass(
            "vocabulary", lambda: find_vocab(self.graph, self.projections, self.embeddings), self.passes_run)
        self._propagations: dict[tuple, Propagation] = {}

    def module(self, node_name: str) -> str:
        """The original module name of a node."""
        return self.captured.module_name(self.nodes[node_name])

    def layer(self, node_name: str) -> str:
        """A readable name for a projection or embedding: its module (``attn.c_attn``), or its parameter
        when the module holds bare parameters (``blocks.0.w_qkv``)."""
        found = self.projections.get(node_name) or self.embeddings.get(node_name)
        module = self.module(node_name)
        if found is None:
            return module or self._nameless(node_name)
        param = self.captured.param_name(found.weight)
        parent, _, short = param.rpartition(".")
        bare = short != "weight" and parent == module
        return param if bare or not module else module

    def _nameless(self, node_name: str) -> str:
        """A node outside every module (a top-level slice, a parameter read): the parameter it reads, else the
        module that first reads it (``before lm_head``); graph-node names mean nothing to people."""
        node = self.nodes[node_name]
        if node.op == "get_attr":
            return self.captured.param_name(node.target)
        seen, frontier = set(), list(node.users)
        while frontier:
            user = frontier.pop(0)
            if user.name in seen:
                continue
            seen.add(user.name)
            if self.module(user.name):
                return f"before {self.module(user.name)}"
            frontier.extend(user.users)
        return "the model's output"

    def regions(self, tp: int) -> RegionSearch:
        """Column→row regions for ``tp`` (LM heads are planned separately)."""
        skip = set(self.vocab.heads) if self.vocab else set()
        return find_regions(self.graph, self.projections, self.embeddings, self.trainable, tp, skip=skip,
                            whole=set(self.chosen_whole), grad=self.grad,
                            adapters={a.base: (a.down, a.up) for a in self.adapters.values()})

    @functools.cached_property
    def grad(self) -> set[str]:
        """The nodes gradients flow through (``graph.grad_nodes``), found once: the region search, the full
        propagations, the pipeline cuts and the collectives all read them."""
        return grad_nodes(self.graph, self.trainable)

    @functools.cached_property
    def adapters(self) -> dict[str, Adapter]:
        """Low-rank adapters added to projections (LoRA), by their up-projection's node (``adapters``)."""
        return run_pass("adapters", lambda: find_adapters(self.graph, self.projections), list(self.passes_run))

    @functools.cached_property
    def embedding_adapters(self) -> dict[str, EmbeddingAdapter]:
        """Low-rank adapters added to token embeddings (LoRA), by their lookup node (``embedding_adapters``)."""
        return run_pass("embedding_adapters", lambda: find_embedding_adapters(self.graph, self.projections,
                                                                              self.embeddings), list(self.passes_run))

    @functools.cached_property
    def chosen_whole(self) -> dict[str, str]:
        """Projections kept whole on purpose (``choices.kept_by_choice``), with why (found once, read by the
        region search and the planner)."""
        heads = self.vocab.heads if self.vocab else ()
        adds = frozenset(adapter_adds(self.graph, self.adapters)) if heads else frozenset()
        reads = frozenset(adapter_reads(self.graph, self.adapters, set(heads)))
        found = {n: kept_by_choice(self.nodes[n], self.projections, heads, adds, reads) for n in self.projections}
        return {n: why for n, why in found.items() if why}

    def propagate_placements(self, placements: Mapping[str, Placement], tp: int, sequence_parallel: bool = False,
                             inputs: Mapping[str, Shard] | None = None) -> Propagation:
        """The propagation of parameter ``placements`` (keyed by original name, tied names included), computed
        once per distinct placements, ``tp``, ``sequence_parallel`` and split ``inputs`` (placeholder name ->
        Shard: a KV cache): read-only, shared by every reader."""
        key = (frozenset(placements.items()), tp, sequence_parallel, frozenset((inputs or {}).items()))
        if key not in self._propagations:
            self._propagations[key] = run_pass(
                "propagation", lambda: self.propagate(self.param_layouts(placements), tp, sequence_parallel, inputs),
                list(self.passes_run))
        return self._propagations[key]

    def param_layouts(self, placements: Mapping[str, Placement]) -> dict[str, Shard]:
        """The split ``placements`` (keyed by original name) as the layouts propagation takes (keyed by the
        ``get_attr`` target each parameter is read through)."""
        by_target = {self.captured.attr_target(self.captured.aliases.get(n, n)): p for n, p in placements.items()}
        # a bank split by its experts computes whole experts: propagation sees it whole (``rewrite.expert_dispatch``)
        return {t: p.layout(self.param_size(t, p.dim)) for t, p in by_target.items()
                if p.is_split and p.kind is not PlacementKind.EXPERT}

    def propagate(self, layouts: Mapping[str, Shard], tp: int, sequence_parallel: bool = False,
                  inputs: Mapping[str, Shard] | None = None) -> Propagation:
        """Propagate parameter layouts (keyed by ``get_attr`` target) through the whole graph, with the residual
        stream split along the sequence when ``sequence_parallel``; ``inputs``: placeholders given split."""
        sequence = self.sequence_sizes if sequence_parallel else frozenset()
        prop = propagate(self.graph, self.projections, self.embeddings, layouts, tp, self.trainable, sequence=sequence,
                         inputs=inputs, grad=self.grad)
        size = uneven_vocabulary(self.vocab, tp)
        if size is not None:  # cut unevenly where it stays the vocabulary, refused where it cannot (uneven_vocab)
            prop.violations[:] = [v for v in prop.violations if not is_the_vocabulary(v, self.vocab)]
            prop.violations.extend(uneven_violations(self.graph, prop, layouts, size, set(self.vocab.embeddings)))
        return prop

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
