"""Rewrite a rank graph to run context-parallel, as ``passes.sequence_split``'s layout says.

The token ids are taken at this rank's positions; split values' sizes become the local length where the graph
spells them; whole values meeting split ones are read at the rank's positions; keys and values (and the inputs
of ops that read across positions) are gathered whole; causal attention gets the mask of the rank's query rows;
outputs are gathered whole and start backward with this rank's share; parameters' gradients are summed over the
ranks (``rewrite.context_ops`` says why that convention is exact).
"""

from __future__ import annotations

from torch import fx

import torch

from autotp.passes.sequence_split import ContextLayout
from autotp.rewrite.comm import Communicator
from autotp.rewrite.context_attention import exchange_attention, without_exchanged
from autotp.rewrite.context_rows import push_rows
from autotp.rewrite.context_ops import Gather, OutputShare, ParamGradSum, Positions, causal_rows

aten = torch.ops.aten


class _Rewrite:
    """One graph's context-parallel rewrite (``apply_context``)."""

    def __init__(self, gm: fx.GraphModule, layout: ContextLayout, comm: Communicator):
        self.gm, self.graph, self.layout, self.comm = gm, gm.graph, layout, comm
        self.nodes = {n.name: n for n in self.graph.nodes}
        gm.add_module("cp_positions", Positions(comm.size, comm.rank))
        self.gathers: dict[tuple, str] = {}

    def gather_module(self, dim: int, kind: str = "gather", merged: tuple | None = None) -> str:
        """The name of the gather along ``dim`` (one module per dim and kind: ``kv`` for attention's keys and
        values, ``output`` for the outputs, ``gather`` for ops that read across positions; each counts its bytes;
        ``merged``: the dim's (outer, inner) factors where it merges the sequence with others)."""
        inner = merged[1] if merged is not None else None
        if (kind, dim, inner) not in self.gathers:
            self.gathers[kind, dim, inner] = f"cp_{kind}_{dim}" + (f"_merged_{inner}" if merged is not None else "")
            self.gm.add_module(self.gathers[kind, dim, inner], Gather(self.comm, self.gm.cp_positions, dim, inner))
        return self.gathers[kind, dim, inner]

    def run(self, trainable: set[str], last: bool = True) -> None:
        self.split_inputs()
        for name in self.layout.lengths:
            self.nodes[name].replace_all_uses_with(self.length)
        for name, index in self.layout.sizes:
            node = self.nodes[name]
            shape = list(node.args[index[0]])
            shape[index[1]] = self.local_length
            node.update_arg(index[0], shape)
        for name, arg in self.layout.gathers:
            node, value = self.nodes[name], self.nodes[arg]
            with self.graph.inserting_before(node):
                kind = "kv" if (name, arg) in self.layout.kv else "gather"
                whole = self.graph.call_module(self.gather_module(self.layout.split[arg], kind,
                                                                  self.layout.merged.get(arg)), (value, self.length))
            node.replace_input_with(value, whole)
        selected = {}  # one read per whole value and dim, right after the value (and the positions) exist
        for name, arg, dim in self.layout.selects:
            node, value = self.nodes[name], self.nodes[arg]
            if (arg, dim) not in selected:
                with self.graph.inserting_before(node) if self.before_positions(value) else \
                        self.graph.inserting_after(value):
                    selected[arg, dim] = self.graph.call_function(aten.index_select.default,
                                                                  (value, dim, self.positions))
            node.replace_input_with(value, selected[arg, dim])
        for name in self.layout.causal:
            self.causal_mask(self.nodes[name])
        if last:  # a pipeline stage before the last passes its hidden state on as it is: the next takes it split
            self.outputs()
        self.params(trainable)
        self.graph.lint()
        self.gm.recompile()

    def before_positions(self, value: fx.Node) -> bool:
        """Whether ``value`` comes before the positions are computed (a parameter or buffer read)."""
        for node in self.graph.nodes:
            if node is value:
                return True
            if node is self.positions:
                return False
        return False

    def split_inputs(self) -> None:
        """Take each token input at this rank's positions (its other readers, which read sizes, keep it whole)."""
        placeholders = [n for n in self.graph.nodes if n.op == "placeholder"]
        first, dim = next((self.nodes[n], d) for n, d in self.layout.inputs.items())
        with self.graph.inserting_after(placeholders[-1]):
            self.length = self.graph.call_function(aten.sym_size.int, (first, dim))
        with self.graph.inserting_after(self.length):
            self.positions = self.graph.call_module("cp_positions", (self.length, first))
        anchor = self.positions
        for name, d in self.layout.inputs.items():
            node = self.nodes[name]
            with self.graph.inserting_after(anchor):
                mine = self.graph.call_function(aten.index_select.default, (node, d, self.positions))
            anchor = mine
            readers = [u for u in node.users if u is not mine and u.op == "call_function"
                       and u.target is not aten.sym_size.int and u is not self.length]
            for user in readers:
                user.replace_input_with(node, mine)
            if name == first.name:
                with self.graph.inserting_after(mine):
                    self.local_length = self.graph.call_function(aten.sym_size.int, (mine, d))
                anchor = self.local_length

    def causal_mask(self, node: fx.Node) -> None:
        """``is_causal`` on the rank's query rows: an explicit mask of them over all keys."""
        with self.graph.inserting_before(node):
            rows = self.graph.call_function(causal_rows, (self.positions, self.length))
        args = list(node.args[:3])
        kwargs = {k: v for k, v in node.kwargs.items() if k not in ("is_causal", "attn_mask")}
        kwargs.update({"attn_mask": rows, "is_causal": False})
        if len(node.args) > 4:
            kwargs["dropout_p"] = node.args[4]
        node.args, node.kwargs = tuple(args), kwargs

    def outputs(self) -> None:
        """Every output whole (split ones gathered), starting backward with this rank's share of the gradient."""
        self.gm.add_module("cp_output", OutputShare(self.comm.size))
        out = next(n for n in self.graph.nodes if n.op == "output")

        def whole(value):
            if not isinstance(value, fx.Node) or not isinstance(value.meta.get("val"), torch.Tensor):
                return value
            with self.graph.inserting_before(out):
                if value.name in self.layout.split:
                    module = self.gather_module(self.layout.split[value.name], "output",
                                                self.layout.merged.get(value.name))
                    value = self.graph.call_module(module, (value, self.length))
                return self.graph.call_module("cp_output", (value,))
        out.args = (fx.node.map_aggregate(out.args[0], whole),)

    def params(self, trainable: set[str]) -> None:
        """Each trainable parameter's read sums its gradient over the ranks."""
        self.gm.add_module("cp_param", ParamGradSum(self.comm))
        for node in list(self.graph.nodes):
            if node.op == "get_attr" and node.target in trainable and node.users:
                with self.graph.inserting_after(node):
                    summed = self.graph.call_module("cp_param", (node,))
                node.replace_all_uses_with(summed, delete_user_cb=lambda u: u is not summed)


def apply_context(gm: fx.GraphModule, layout: ContextLayout, comm: Communicator, trainable: set[str],
                  last: bool = True) -> None:
    """Rewrite ``gm`` in place to compute this rank's tokens (``comm``: the cp ranks; ``trainable``: the
    ``get_attr`` targets of the parameters). Attentions the layout exchanges by ring or Ulysses
    (``layout.methods``) are replaced by their calls (``rewrite.context_attention``). ``last``: False for a
    pipeline stage before the last, whose outputs (its hidden state, split, and the model's inputs) are passed on
    as they are (``rewrite.context_stages``)."""
    rewrite = _Rewrite(gm, without_exchanged(layout), comm)
    rewrite.run(trainable, last)
    exchange_attention(gm, layout, comm, rewrite.length)
    push_rows(gm, layout.seq, rewrite.positions, rewrite.local_length)
