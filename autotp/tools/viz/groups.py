"""Group a captured fx graph into the boxes a person reads: one per module, or per run of ops of a module.

The captured graph has hundreds of aten ops; a reader thinks in modules (``attn.c_attn``, ``ln_1``)
and in the few ops between them (the attention core, the residual add). This module only reads the
graph: it returns a ``networkx.DiGraph`` of groups that stays acyclic by construction.
"""

from __future__ import annotations

import operator
from collections import Counter

import networkx as nx
from torch import fx

from autotp.capture import Captured

SKIPPED_OPS = {"sym_size", "_assert_tensor_metadata", "_assert_scalar", "sym_constrain_range_for_size"}
"""Ops that compute shapes or check them: never drawn."""

GLUE_OPS = {"dropout", "view", "reshape", "transpose", "contiguous", "clone", "alias", "to", "_to_copy", "expand",
            "unsqueeze", "squeeze", "getitem", "permute", "t", "flatten", "detach", "identity", "type_as",
            "lift_fresh_copy", "slice"}
"""Ops that move or relabel data: a group made only of them folds into the box that feeds it."""

SHORT_NAMES = {"scaled_dot_product_attention": "sdpa", "wrap_with_set_grad_enabled": "no-grad subgraph"}


def op_name(node: fx.Node) -> str:
    """A short name for a node's op (``aten.linear.default`` -> ``linear``)."""
    target = node.target
    if target is operator.getitem:
        return "getitem"
    name = getattr(target, "_opname", None) or getattr(target, "__name__", None) or str(target)
    return name.rstrip("_") if name.endswith("_") and not name.startswith("_") else name


def module_class(node: fx.Node) -> str:
    """The class name of the innermost module a node ran in (``Linear``), or ''."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    cls = list(stack.values())[-1][1]
    name = cls if isinstance(cls, str) else getattr(cls, "__name__", "")
    return name.rpartition(".")[2]


def _is_tensor(node: fx.Node) -> bool:
    val = node.meta.get("val")
    return hasattr(val, "shape") or isinstance(val, (tuple, list))


def _kept_nodes(captured: Captured) -> dict[str, dict]:
    """The nodes worth drawing, each with its module, op, parameters and position.

    A node is kept when it carries data that comes from the input or from a parameter: positions,
    masks and other values computed from shapes alone are left out.
    """
    params = set(captured.param_names)
    kept: dict[str, dict] = {}
    for index, node in enumerate(captured.graph.nodes):
        if node.op == "placeholder":
            kept[node.name] = dict(module="", op="input", params=[], cls="", index=index, inputs=[])
            continue
        if node.op == "output":
            inputs = [a.name for a in node.all_input_nodes if a.name in kept]
            kept[node.name] = dict(module="", op="output", params=[], cls="", index=index, inputs=inputs)
            continue
        if node.op != "call_function" or op_name(node) in SKIPPED_OPS or not _is_tensor(node):
            continue
        attrs = [a for a in node.all_input_nodes if a.op == "get_attr"]
        own = [captured.param_name(a.target) for a in attrs if captured.param_name(a.target) in params]
        inputs = [a.name for a in node.all_input_nodes if a.name in kept]
        if not (own or inputs or len(attrs) > len(own)):  # buffers (rotary tables) count as data too
            continue
        module = captured.module_name(node)
        info = dict(module=module, op=op_name(node), params=own, cls=module_class(node), index=index, inputs=inputs)
        info["module"] = _bare_box(info, {a.target: a for a in attrs}, captured, kept)
        kept[node.name] = info
    return kept


def _bare_box(info: dict, attrs: dict, captured: Captured, kept: dict[str, dict]) -> str:
    """The box of a node in a module that holds bare parameters (``x @ self.w_qkv + self.b_qkv``).

    Each bare weight is its own box, named by the parameter as the plan's regions name it; its bias
    add, and the matmul reading it through a transpose, join that box. Elsewhere the box is the module.
    """
    module = info["module"]

    def bare(name: str) -> bool:
        parent, _, short = name.rpartition(".")
        return parent == module and short not in ("weight", "bias")

    ndim = {captured.param_name(t): getattr(a.meta.get("val"), "ndim", 0) for t, a in attrs.items()}
    weights = [p for p in info["params"] if bare(p) and ndim.get(p, 0) >= 2]
    if weights:
        return weights[0]
    sources = [kept[i] for i in info["inputs"]]
    if not info["params"]:  # the matmul of a bare weight read through a transpose joins its box
        carriers = [s["module"] for s in sources if s["op"] in GLUE_OPS and s["params"] and s["module"] != module]
        return carriers[0] if carriers else module
    if any(bare(p) for p in info["params"]):  # a bias added to a bare projection joins its box
        boxes = [s["module"] for s in sources if s["module"] in s["params"]]
        return boxes[0] if boxes else module
    return module


def _segments(kept: dict[str, dict]) -> tuple[nx.DiGraph, dict[str, str]]:
    """Consecutive nodes (in graph order) of one module form a segment; returns segments and node -> segment."""
    g = nx.DiGraph()
    owner: dict[str, str] = {}
    current, key = None, None
    for name, info in kept.items():
        boundary = info["op"] in ("input", "output")
        if boundary or current is None or info["module"] != key or g.nodes[current]["io"]:
            current, key = f"g{len(g)}", info["module"]
            g.add_node(current, module=key, ops=[], params=[], cls=info["cls"], index=info["index"], io=boundary)
        data = g.nodes[current]
        data["ops"].append(info["op"])
        data["params"].extend(p for p in info["params"] if p not in data["params"])
        data["cls"] = data["cls"] if info["params"] == [] and data["cls"] else info["cls"] or data["cls"]
        owner[name] = current
        for src in info["inputs"]:
            if owner[src] != current:
                g.add_edge(owner[src], current)
    return g, owner


def _indirect_path(g: nx.DiGraph, src: str, dst: str) -> bool:
    """Whether ``dst`` is reachable from ``src`` other than by a direct edge."""
    stack = [s for s in g.successors(src) if s != dst]
    seen = set(stack)
    while stack:
        node = stack.pop()
        if node == dst:
            return True
        for nxt in g.successors(node):
            if nxt not in seen:
                seen.add(nxt)
                stack.append(nxt)
    return False


def _merge_into(g: nx.DiGraph, keep: str, drop: str) -> None:
    a, b = g.nodes[keep], g.nodes[drop]
    a["ops"] += b["ops"]
    a["params"] += [p for p in b["params"] if p not in a["params"]]
    a["cls"] = a["cls"] or b["cls"]
    a["index"] = min(a["index"], b["index"])
    nx.contracted_nodes(g, keep, drop, self_loops=False, copy=False)
    g.nodes[keep].pop("contraction", None)


def _merge_same_module(g: nx.DiGraph) -> None:
    """Merge segments of one module (Q, K and V each followed by the attention's reshapes) while acyclic."""
    latest: dict[str, list[str]] = {}
    for seg in list(g.nodes):
        data = g.nodes[seg]
        if data["io"]:
            continue
        for candidate in reversed(latest.get(data["module"], [])):
            if not _indirect_path(g, candidate, seg) and not _indirect_path(g, seg, candidate):
                _merge_into(g, candidate, seg)
                break
        else:
            latest.setdefault(data["module"], []).append(seg)


def _fold_glue(g: nx.DiGraph) -> None:
    """Fold groups of data-movement ops (dropout, reshapes) into the single group that feeds them."""
    for seg in list(g.nodes):
        data = g.nodes[seg]
        preds = list(g.predecessors(seg))
        if data["io"] or data["params"] or len(preds) != 1 or g.nodes[preds[0]]["io"]:
            continue
        if set(data["ops"]) <= GLUE_OPS:
            _merge_into(g, preds[0], seg)


def op_summary(ops: list[str], limit: int = 3) -> str:
    """The ops a group runs, the telling ones first (``sdpa · split · view x3``)."""
    counts = Counter(SHORT_NAMES.get(o, o) for o in ops if o != "getitem" or set(ops) == {"getitem"})
    ranked = sorted(counts.items(), key=lambda kv: (kv[0] in GLUE_OPS, -kv[1]))
    parts = [f"{name} x{n}" if n > 1 else name for name, n in ranked[:limit]]
    return " · ".join(parts) + (" …" if len(ranked) > limit else "")


def module_groups(captured: Captured) -> nx.DiGraph:
    """The captured model as an acyclic graph of groups.

    Each node holds ``module`` (original module name, '' at top level), ``ops`` (short op names),
    ``params`` (original parameter names it reads), ``cls`` (module class name), ``index`` (first
    position in the captured graph) and ``io`` (the model's inputs and output).
    """
    g, _ = _segments(_kept_nodes(captured))
    _merge_same_module(g)
    _fold_glue(g)
    return g
