"""Capture of a loop over the experts a batch routes tokens to, as eager mixture-of-experts layers write it:

    hit = (expert_mask.sum(dim=(-1, -2)) > 0).nonzero()     # which experts got tokens: data-dependent
    for expert in hit:
        slot, token = torch.where(expert_mask[expert[0]])  # that expert's tokens
        if token.numel() == 0: continue                    # (some models check again)
        out.index_add_(0, token, expert_mlp(x[token]) * weights[token, slot, None])

torch.export cannot trace a loop whose length is a tensor's value. Running the body for an expert that got no
token changes nothing (its tokens select nothing, so it adds nothing), so the loop is captured over every index
of the routing vector (every expert, whatever the example routed), in order: the expert is a constant
in each iteration, its tokens an empty selection when it has none, and a guard on that selection being empty
takes the branch that computes it (the same ops, on no rows); a body that reads its expert as a Python number
(``experts[f"expert_{e[0]}"]``) reads the constant. Sound only if each iteration's effect is such a
write, so the captured graph is checked for it (``check_routed_writes``). Where a body cannot be traced for an
index the example never routed to (``W[e]`` past a bank's end, for the last class of a mask, meaning "no
expert"), it is captured over every index but that last one, or failing that over the experts the example routes
tokens to only; a batch that routes tokens to an index left out (which the loop would then miss) raises
``UnseenExpertError`` (the graph's runtime assertion of that, ``unseen_experts``).
"""

from __future__ import annotations

import contextlib
import os
import traceback
import warnings

import torch
from torch import fx
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode, guard_size_oblivious
from torch.fx.traceback import annotate, preserve_node_meta

from autotp.torch_private import check, methods_replaced, symbolic_expr
from autotp.errors import CaptureError, UnseenExpertError
from autotp.passes.loop_banks import ITERATION  # the key ``passes.loop_banks`` reads the iterations by

aten = torch.ops.aten


UNSEEN = "autotp_unseen_experts"
"""``node.meta["custom"]`` key naming the place of the loop whose check (no token routed to another expert) the
node computes."""

WRITES = frozenset({aten.index_add.default, aten.index_add_.default, aten.index_put.default, aten.index_put_.default,
                    aten.index_copy.default, aten.index_copy_.default, aten.scatter_add.default,
                    aten.scatter_add_.default, aten.scatter.src, aten.scatter_.src})
"""Writes of rows picked by an index into a tensor: with no rows picked, they leave it as it is."""

_MAX_EXPERTS = 4096
"""Longest routing vector treated as experts (a mask over tokens, far longer, is not a loop over experts)."""


class _Loops:
    """What the patched ``nonzero`` and ``__iter__`` see: the routing vectors (1-D boolean tensors whose ``nonzero``
    is taken), the experts hit per vector length, and whether a routed loop's body is being traced."""

    def __init__(self, hits: dict[int, set[int]] | None = None):
        self.sources: dict[int, tuple[torch.Tensor, torch.Tensor, str]] = {}
        self.hits = {} if hits is None else hits
        self.recording = hits is None
        self.in_body = False
        self.loops = 0
        self.places: list[str] = []


def _caller() -> str:
    """The model's line that took the ``nonzero`` (outside torch and this file)."""
    torch_dir = os.path.dirname(torch.__file__)
    for frame in reversed(traceback.extract_stack()[:-2]):
        if not frame.filename.startswith(torch_dir) and frame.filename != __file__:
            return f"`{(frame.line or '').strip()}` ({os.path.basename(frame.filename)}:{frame.lineno})"
    return "?"


@contextlib.contextmanager
def _patched(loops: _Loops):
    nonzero, iterate, truth = torch.Tensor.nonzero, torch.Tensor.__iter__, torch.SymBool.__bool__
    form = torch.Tensor.__format__

    def routed_nonzero(self, *args, **kwargs):
        out = nonzero(self, *args, **kwargs)
        if not args and not kwargs.get("as_tuple") and self.dim() == 1 and self.dtype == torch.bool \
                and isinstance(self.shape[0], int) and self.shape[0] <= _MAX_EXPERTS:
            loops.sources[id(out)] = (out, self, _caller())
        return out

    def routed_iter(self):
        source = loops.sources.get(id(self))
        if source is None or source[0] is not self:
            return iterate(self)
        if loops.recording:
            loops.hits.setdefault(source[1].shape[0], set()).update(self.flatten().tolist())
            return iterate(self)
        return _experts(loops, self, source[1], source[2])

    def oblivious_truth(self):
        try:
            return truth(self)
        except GuardOnDataDependentSymNode:
            if not loops.in_body:
                raise
            # an expert's selection being empty: the branch that computes it (the same ops, on no rows), where
            # that is the branch every non-empty selection takes
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                taken = guard_size_oblivious(self)
            if not _same_for_any_rows(self, taken):
                raise
            return taken

    def constant_format(self, spec):
        # an expert read as a Python number (``self[f"expert_{idx[0]}"]``, a ModuleDict of experts): the body's
        # expert is a constant, which its fake tensor carries; a fake tensor formats as its description otherwise
        constant = getattr(self, "constant", None)
        if loops.in_body and constant is not None and self.dim() == 0:
            return constant.item().__format__(spec)
        return form(self, spec)

    with methods_replaced({(torch.Tensor, "nonzero"): routed_nonzero, (torch.Tensor, "__iter__"): routed_iter,
                           (torch.SymBool, "__bool__"): oblivious_truth,
                           (torch.Tensor, "__format__"): constant_format}):
        yield loops


def _same_for_any_rows(condition: torch.SymBool, taken: bool) -> bool:
    """Whether ``condition`` (on sizes only) is ``taken`` whatever nonzero sizes its symbols have (tried at 1, 2, 3
    and a large one): ``numel() == 0`` is, ``numel() == 1`` is not."""
    expr = symbolic_expr(condition)
    for size in (1, 2, 3, 1 << 20):
        value = expr.subs({symbol: size for symbol in expr.free_symbols})
        if value not in (True, False) or bool(value) != taken:
            return False
    return True


def _experts(loops: _Loops, rows: torch.Tensor, routing: torch.Tensor, place: str):
    """The rows ``routing.nonzero()`` gives for every expert the example hit (constants), after a runtime check
    that the batch hits no other."""
    hit = sorted(loops.hits.get(routing.shape[0], ()))
    loop = loops.loops
    loops.loops += 1
    loops.places.append(place)
    if len(hit) < routing.shape[0]:  # not every expert: a batch routing to one left out must not pass silently
        outside = torch.ones(routing.shape[0], dtype=torch.bool, device=routing.device)
        outside[hit] = False
        with annotate({UNSEEN: place}):
            missed = (routing & outside).sum().item()
        check(missed == 0, lambda: f"the batch routes tokens to an expert the example inputs did not ({place})")
    for expert in hit:
        loops.in_body = True
        with annotate({ITERATION: (loop, expert)}):
            yield torch.tensor([expert], dtype=rows.dtype, device=rows.device)
        loops.in_body = False


def example_hits(run) -> dict[int, set[int]]:
    """Run ``run()`` (the model on its example) and return, per length of a routing vector whose ``nonzero`` a
    loop iterates over, the experts it hits; empty when the forward has no such loop. The random generators are
    left as they were (a dropout before the router draws)."""
    with _patched(_Loops()) as loops, torch.no_grad(), torch.random.fork_rng():
        run()
    return loops.hits


def iterates_data(error: BaseException) -> bool:
    """Whether a failed capture broke iterating over a tensor whose length is data (``for e in x.nonzero()``)."""
    return isinstance(error, GuardOnDataDependentSymNode) and any(
        f.name == "__iter__" for f in traceback.extract_tb(error.__traceback__))


def export_over_routed_experts(wrapper: torch.nn.Module, inputs: tuple, dynamic_shapes, error: BaseException):
    """Where the plain capture's ``error`` is a loop over a data-dependent length, capture ``wrapper(*inputs)`` with
    each loop over ``routing.nonzero()`` run over the experts the example routes tokens to (checked by
    ``check_routed_writes``). Returns the module and one line per loop (where it is, what the capture assumes),
    or None when the forward has no such loop. The example's eager run leaves the buffers as they were."""
    if not iterates_data(error):
        return None
    buffers = [(b, b.detach().clone()) for b in wrapper.buffers()]
    try:
        hits = example_hits(lambda: wrapper(*inputs))
    finally:
        with torch.no_grad():
            for b, kept in buffers:
                b.copy_(kept)
    if not hits:
        return None
    tries = ((_every(hits, 0), "every expert (every index of its routing vector, whatever the example routed)"),
             # a mask with a class for no expert (``one_hot(..., E + 1)``) whose body cannot run for it
             (_every(hits, 1), "every expert (every index of its routing vector but the last, a class for no "
                               "expert, which a batch routing to raises)"),
             (hits, "the experts the example routes to (its body could not be traced for the others); a batch "
                    "routing to another expert raises"))
    for i, (over, said) in enumerate(tries):
        try:
            program, places = _export_over(over, wrapper, inputs, dynamic_shapes)
            break
        except Exception:  # noqa: BLE001 - a body that cannot run for an index never routed to: the next try
            if i == len(tries) - 1:
                raise
    check_routed_writes(program.graph_module)
    module = program.module()
    unseen_experts(module.graph)
    module.recompile()
    return module, tuple(f"the loop over the experts the batch routes to at {place} runs over {said}, each "
                         "adding nothing when no token is routed to it" for place in dict.fromkeys(places))


def _every(hits: dict[int, set[int]], last_left_out: int) -> dict[int, set[int]]:
    """Every index of each routing vector (less its last ``last_left_out``), with the indices ``hits`` names."""
    return {length: set(range(length - last_left_out)) | hit for length, hit in hits.items()}


def _export_over(hits: dict[int, set[int]], wrapper: torch.nn.Module, inputs: tuple, dynamic_shapes):
    """The exported program with each routed loop run over ``hits``, and the loops' places."""
    with routed_loops_over(hits) as places, preserve_node_meta():
        program = torch.export.export(wrapper, inputs, strict=False, dynamic_shapes=dynamic_shapes)
    return program, places


@contextlib.contextmanager
def routed_loops_over(hits: dict[int, set[int]]):
    """Within the body, a loop over ``routing.nonzero()`` runs over the experts ``hits`` names (see the module's
    docstring); yields the list of the loops' places, filled as they are traced."""
    with _patched(_Loops(hits)) as loops:
        yield loops.places


def unseen_experts(graph: fx.Graph) -> None:
    """Make the runtime assertions that a batch routes no token to an expert the capture did not loop over raise
    ``UnseenExpertError`` (``unseen_expert_check``) instead of torch's assertion on an unnamed size."""
    counts = {n for n in graph.nodes if (n.meta.get("custom") or {}).get(UNSEEN) is not None}
    for node in graph.find_nodes(op="call_function", target=aten._assert_scalar.default):
        read = [c for c in counts if c in _inputs_upstream(node)]
        if read:
            node.target = unseen_expert_check
            node.args = (node.args[0], read[0].meta["custom"][UNSEEN])


def _inputs_upstream(node: fx.Node, depth: int = 3) -> set[fx.Node]:
    """The nodes ``node`` reads, and those they read, ``depth`` steps up (a check compares the count it reads)."""
    seen, frontier = set(), [node]
    for _ in range(depth):
        frontier = [a for n in frontier for a in n.all_input_nodes if a not in seen]
        seen.update(frontier)
    return seen


def unseen_expert_check(condition, place: str) -> None:
    """Raise ``UnseenExpertError`` unless ``condition`` (no token of the batch is routed to an expert the loop at
    ``place`` was not captured for)."""
    if not condition:
        raise UnseenExpertError(f"the batch routes tokens to an expert that the loop over the experts hit at {place} "
                                "was not captured for (the example inputs route no token to it): capture with example "
                                "inputs that route tokens to every expert, or a longer example")


def check_routed_writes(gm: fx.GraphModule) -> None:
    """Refuse a routed loop whose body does more than write its expert's rows: each iteration's values may leave
    it only through a write (``index_add_``, ``index_put_``, ``scatter_add_``) of rows whose count is a size
    first seen in that iteration (its tokens), which writes nothing for an expert without tokens."""
    by_iteration: dict[tuple, list[fx.Node]] = {}
    for node in gm.graph.nodes:
        key = (node.meta.get("custom") or {}).get(ITERATION)
        if key is not None:
            by_iteration.setdefault(key, []).append(node)
    seen: set = set()
    for key, nodes in by_iteration.items():
        inside = set(nodes)
        born = _unbacked(nodes) - seen
        seen |= born
        for node in nodes:
            leaves = [u for u in node.users if u not in inside] + ([node] if node.op == "output" else [])
            if leaves and not _empty_write(node, born):
                raise CaptureError(f"cannot capture the loop over the experts the batch routes to: expert {key[1]}'s "
                                   f"iteration passes `{node.name}` ({node.target}) on, which is not a write of its "
                                   "tokens' rows, so an expert without tokens would still change the result")


def _unbacked(nodes: list[fx.Node]) -> set:
    out = set()
    for node in nodes:
        val = node.meta.get("val")
        for v in (val if isinstance(val, (tuple, list)) else [val]):
            for d in getattr(v, "shape", ()):
                if isinstance(d, torch.SymInt):
                    out |= {s for s in symbolic_expr(d).free_symbols if str(s).startswith("u")}
    return out


def _empty_write(node: fx.Node, born: set) -> bool:
    """Whether ``node`` writes rows picked by an index whose size is one of ``born`` (nothing, when it is 0)."""
    if node.op != "call_function" or node.target not in WRITES:
        return False
    sources = [a for a in node.args[1:] if isinstance(a, fx.Node)]
    return bool(sources) and all(_unbacked([s]) & born for s in sources)
