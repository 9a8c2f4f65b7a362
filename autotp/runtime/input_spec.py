"""What a parallel module accepts: the inputs the model was captured with, by name, checked before they run.

A call may pass each input positionally or by keyword, as the original model's forward allows; they are put
in the captured graph's order here. A wrong input inside the rank graph would surface as a raw torch error
(or a failed export guard) in the middle of a forward; here it becomes an ``InputError`` saying what was
expected.
"""

from __future__ import annotations

from dataclasses import dataclass

import sympy
import torch
from torch import fx

from autotp.capture import Captured, Signature, name_inputs
from autotp.errors import AutotpError, InputError
from autotp.passes.graph import sizes
from autotp.passes.projections import find_embeddings
from autotp.planning import Plan
from autotp.runtime.batch_agreement import check_token_ids
from autotp.runtime.labels import LABELS, labels_feed_loss_only, stand_in
from autotp.runtime.loss import without_loss


@dataclass(frozen=True)
class InputSpec:
    """The model inputs a rank graph takes: their names, dtypes and numbers of dims, in the graph's order."""

    names: tuple[str, ...]
    dtypes: tuple[torch.dtype, ...]
    dims: tuple[int, ...]
    signature: Signature
    """The original forward's parameters, which name the inputs of a call."""
    sequence_dims: tuple[tuple[int, int], ...] = ()
    """(input, dim) pairs holding a sequence that sequence parallelism splits over ``tp`` ranks."""
    tp: int = 1
    vocab: tuple[tuple[int, int, str], ...] = ()
    """(input, table rows, table name) for each input read as token ids by an embedding table."""
    sizes: tuple[tuple[str, ...], ...] = ()
    """Each input's sizes as captured (a symbol's name where dynamic): inputs sharing a symbol must agree."""
    optional_labels: bool = False
    """Whether a forward may leave out ``labels`` (they feed the loss alone: ``runtime.labels``)."""

    @classmethod
    def of(cls, captured: Captured, plan: Plan | None = None) -> InputSpec:
        """The spec of a captured model's inputs (under ``plan``: which dims its sequence parallelism splits)."""
        placeholders = list(captured.graph.find_nodes(op="placeholder"))
        values = [n.meta.get("val") for n in placeholders]
        sequence_dims = ()
        if plan is not None and plan.sequence_parallel:
            sequence = captured.analysis.sequence_sizes
            sequence_dims = tuple((i, d) for i, n in enumerate(placeholders) for d, size in enumerate(sizes(n))
                                  if sympy.sympify(size) in sequence)
        return cls(captured.input_names, tuple(v.dtype for v in values), tuple(v.dim() for v in values),
                   captured.signature, sequence_dims, plan.tp if plan is not None else 1,
                   token_tables(captured.graph, placeholders),
                   tuple(tuple(str(s) for s in sizes(n)) for n in placeholders),
                   LABELS in captured.input_names
                   and labels_feed_loss_only(captured.graph, captured.input_names, captured.out_spec))

    def arrange(self, args: tuple, kwargs: dict, stand_in_labels: bool = False) -> tuple[torch.Tensor, ...]:
        """The call's inputs in the graph's order; ``InputError`` names the first that is missing, extra or
        does not fit. With ``stand_in_labels``, labels left out of a call are made up where they feed the loss
        alone (``fills_labels`` says whether they would be)."""
        named = name_inputs(self.signature, args, kwargs)
        if stand_in_labels and self.fills_labels(named):
            named[LABELS] = self._stand_in(named)
        extra = [name for name in named if name not in self.names]
        if extra:
            raise InputError(f"{extra[0]} is not an input the model was captured with (it was captured with "
                             f"{', '.join(self.names)}); {_capture_hint(extra[0])}")
        missing = [name for name in self.names if name not in named]
        if missing:
            raise InputError(f"input {missing[0]} is missing: the model was captured with {', '.join(self.names)}; "
                             "pass the same inputs as example_inputs (positionally or by name)")
        flat = tuple(named[name] for name in self.names)
        for name, x, dtype, dims in zip(self.names, flat, self.dtypes, self.dims):
            _check_one(name, x, dtype, dims)
        _check_sizes(self.names, flat, self.sizes)
        check_token_ids(self.names, flat, self.vocab)
        for i, dim in self.sequence_dims:
            if flat[i].shape[dim] % self.tp:
                raise InputError(f"input {self.names[i]} has a sequence of {flat[i].shape[dim]} (dim {dim}), which "
                                 f"sequence parallelism splits over tp={self.tp} ranks: pad it to a multiple of "
                                 f"{self.tp}, or plan without sequence_parallel")
        return flat

    def fills_labels(self, named: dict) -> bool:
        """Whether a call of these named inputs leaves out labels that a stand-in can replace."""
        return self.optional_labels and LABELS not in named and self._stand_in(named) is not None

    def _stand_in(self, named: dict):
        i = self.names.index(LABELS)
        return stand_in(self.sizes[i], self.dtypes[i], named, dict(zip(self.names, self.sizes)))

    def run(self, module: fx.GraphModule, args: tuple, kwargs: dict, agree=None, stand_in_labels: bool = False):
        """``module`` on the call's inputs, after checking them; ``agree(inputs)`` begins the check across ranks and
        returns the function completing it, called once the module has run or failed (a mismatch found then is
        the cause to report). A failed capture guard becomes an ``InputError``. With ``stand_in_labels`` a call
        without labels gets the output the model gives without them (``runtime.labels``)."""
        dropped = stand_in_labels and self.fills_labels(name_inputs(self.signature, args, kwargs))
        flat = self.arrange(args, kwargs, stand_in_labels)
        complete = agree(flat) if agree is not None else None
        try:
            return without_loss(module(*flat)) if dropped else module(*flat)
        except AssertionError as e:
            if "Guard failed" not in str(e):
                raise
            guard = str(e).strip().splitlines()[0]
            if dropped:
                raise self._stand_in_failed(flat, guard) from e
            raise InputError(f"these inputs' sizes are outside what the model was captured for ({guard}); the "
                             "capture keeps sizes dynamic only within the bounds the model's code allows (a "
                             "position table, a cached mask), and an image's height and width not at all: use "
                             "shorter inputs, or capture with example_inputs of the longest size (the image size) "
                             "you will use") from e
        except RuntimeError as e:
            if not dropped or isinstance(e, AutotpError):
                raise
            raise self._stand_in_failed(flat, e) from e
        finally:
            if complete is not None:
                complete()

    def _stand_in_failed(self, flat: tuple, why) -> InputError:
        """The error for stand-in labels the model's loss (or its captured sizes) did not take."""
        shape = tuple(flat[self.names.index(LABELS)].shape)
        return InputError(f"the model was captured with labels and called without them; stand-in labels of shape "
                          f"{shape} did not fit its loss ({why}): pass labels, or capture without them to evaluate")


def _capture_hint(name: str) -> str:
    """How to make ``name`` an input: the graph is fixed at capture, so it must be in the example."""
    if name == "labels":
        return ("to train on the model's own loss, capture with labels too, e.g. "
                "example_inputs={'input_ids': ids, 'labels': ids}; or pass target= to step instead")
    return f"capture with it among the example inputs (example_inputs={{..., '{name}': ...}}), or leave it out"


def _check_one(name: str, x, dtype: torch.dtype, dims: int) -> None:
    if not isinstance(x, torch.Tensor):
        raise InputError(f"input {name} is a {type(x).__name__}, not a tensor")
    if x.is_floating_point() != dtype.is_floating_point or x.dim() != dims:
        raise InputError(f"input {name} is a {x.dim()}-d {x.dtype} tensor but the model was captured with a "
                         f"{dims}-d {dtype} one (token ids are integers); pass inputs like example_inputs")
    if x.is_meta:
        raise InputError(f"input {name} is on the meta device (it has no values); pass real tensors")
    if x.numel() == 0:
        raise InputError(f"input {name} is empty (shape {tuple(x.shape)}): a batch of no rows or tokens has nothing "
                         "to compute; skip it, or pass at least one row")


def _check_sizes(names: tuple[str, ...], flat: tuple, captured: tuple[tuple[str, ...], ...]) -> None:
    """Inputs captured with one size symbol (an attention mask and its ids share the sequence) must agree."""
    seen: dict[str, tuple[str, int, int]] = {}
    for name, x, dims in zip(names, flat, captured):
        for d, symbol in enumerate(dims):
            if symbol.isdigit():
                continue
            first = seen.setdefault(symbol, (name, d, x.shape[d]))
            if x.shape[d] != first[2]:
                raise InputError(f"input {name} has {x.shape[d]} at dim {d} but {first[0]} has {first[2]} at dim "
                                 f"{first[1]}: the model was captured with both the same size (the batch or the "
                                 "sequence); pass inputs of matching shapes (an attention_mask as long as its ids)")


_VIEWS = {torch.ops.aten.view.default, torch.ops.aten.reshape.default, torch.ops.aten._unsafe_view.default,
          torch.ops.aten.unsqueeze.default, torch.ops.aten.flatten.using_ints}


def token_tables(graph: fx.Graph, placeholders: list[fx.Node]) -> tuple[tuple[int, int, str], ...]:
    """(input index, rows, table name) for each input an embedding table reads as ids (through reshapes)."""
    index = {n: i for i, n in enumerate(placeholders)}
    nodes = {n.name: n for n in graph.nodes}
    found = {}
    for embedding in find_embeddings(graph).values():
        ids = nodes[embedding.ids]
        while ids.op == "call_function" and ids.target in _VIEWS:
            ids = ids.args[0]
        if ids in index:
            found.setdefault(index[ids], (index[ids], embedding.num_embeddings, embedding.weight))
    return tuple(found.values())
