"""The tensor-parallel runtime: the module a user trains, and how its state maps back to the original.

``ParallelModule`` runs one rank's rewritten graph; ``full_state_dict`` gathers the shards back into
tensors under the original model's state-dict keys.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import fx, nn

from autotp.capture import Captured
from autotp.errors import InputError
from autotp.planning.plan import Plan
from autotp.rewrite.comm import Communicator
from autotp.rewrite.random import RankStream
from autotp.rewrite.shards import Part, assemble, segments_or_whole
from autotp.rewrite.tensor_parallel import Source, Want, own_tensors
from autotp.runtime.checkpoint import Checkpointing, Holding, holding
from autotp.runtime.data_parallel import DataParallel, gathered, local
from autotp.runtime.grad_norm import clip_grad_norm_, is_counted
from autotp.runtime.inputs import InputSpec
from autotp.runtime.outputs import SplitOutputs, default_loss, deferred, output_gathers, user_loss
from autotp.runtime.process import close_at_exit


def model_loss(output) -> torch.Tensor | None:
    """The loss the model computed itself (a Hugging Face model given ``labels``: ``output.loss``), or None."""
    if isinstance(output, dict):
        return output.get("loss")
    return getattr(output, "loss", None)


def step_loss(output, target: torch.Tensor | None, loss_fn: Callable | None,
              split: SplitOutputs | None = None) -> torch.Tensor:
    """The loss ``step`` trains on: ``loss_fn`` (default: cross-entropy) against ``target`` when given, else the
    model's own (computed from ``labels`` inside the model). ``split``: the outputs the step left split."""
    if target is not None:
        if loss_fn is None:
            return checked_loss(default_loss(output, target, split))
        return checked_loss(user_loss(loss_fn, output, target, split))
    if loss_fn is not None:
        raise InputError("loss_fn is called as loss_fn(output, target), but no target= was given; pass target=")
    loss = model_loss(output)
    if loss is None:
        raise InputError("step needs a loss: pass target= (with the default cross-entropy or your loss_fn), or "
                         "labels= to a model that computes its own loss (a Hugging Face model's output.loss); "
                         "this model's output has no loss")
    return checked_loss(loss)


def checked_loss(loss) -> torch.Tensor:
    """A loss function's result, which must be a scalar tensor with a gradient to follow."""
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        got = f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise InputError(f"loss_fn must return a scalar tensor (e.g. a mean), got {got}; reduce it with .mean() or "
                         ".sum() inside loss_fn")
    if not loss.requires_grad:
        raise InputError("loss_fn returned a tensor with no gradient history (made with .item(), .detach() or "
                         "torch.no_grad?); compute it from the model's output with torch operations")
    return loss


@dataclass
class StateNames:
    """How a rank's module names map back to the original model's state dict."""

    state_keys: tuple[str, ...]
    """Keys of the original ``model.state_dict()``, in order."""
    aliases: dict[str, str]
    """Every name -> the name its (possibly tied) tensor is kept under."""
    param_name: Callable[[str], str]
    """Attribute target in a rank module -> original name."""
    extra_state: dict[str, object]
    """State the graph never reads (unused buffers, ``None`` or other extra state), kept so full_state_dict
    has every key."""

    def local(self, module: nn.Module) -> dict[str, torch.Tensor]:
        """A rank module's tensors (shards for split parameters) under the original names."""
        return {self.param_name(k): v for k, v in module.state_dict().items() if not k.startswith("autotp_")}

    def params(self, module: nn.Module) -> dict[str, nn.Parameter]:
        """A rank module's parameters under the original names."""
        return {self.param_name(k): p for k, p in module.named_parameters()}

    def complete(self, full: dict[str, torch.Tensor]) -> dict[str, object]:
        """Every original key, from full tensors keyed by kept names."""
        full = full | {k: _copy(v) for k, v in self.extra_state.items()}
        return {k: full[self.aliases.get(k, k)] for k in self.state_keys}


def _copy(value):
    return value.detach().clone() if isinstance(value, torch.Tensor) else value


def state_names(model: nn.Module, captured: Captured, modules, source: Source | None = None) -> StateNames:
    """The state-dict bookkeeping for rank modules built from ``captured``; ``source`` gives the values of state
    the graph never reads (default: the model's own)."""
    kept = {captured.param_name(k) for m in modules for k in m.state_dict()}
    # Every rank keeps a copy of state the graph never reads, so full_state_dict has every key.
    extra = {k: _copy(v) for k, v in model.state_dict().items() if captured.aliases.get(k, k) not in kept}
    tensors = [k for k, v in extra.items() if isinstance(v, torch.Tensor)]
    wants = [Want(captured.aliases.get(k, k), extra[k], Part(tuple(extra[k].shape))) for k in tensors]
    extra |= dict(zip(tensors, (source or own_tensors)(wants)))
    return StateNames(captured.state_keys, captured.aliases, captured.param_name, extra)


def split_param(plan: Plan, names: StateNames, target: str, tp_rank: int = 0) -> bool:
    """Whether the parameter a rank module holds at ``target`` is split over the tensor-parallel ranks and this
    rank's chunk is its own (of a chunk several ranks hold, only the first holder's counts as its own)."""
    name = names.param_name(target)
    placement = plan.placements.get(names.aliases.get(name, name))
    return placement is not None and placement.is_split and plan.tp > 1 and tp_rank % placement.replicas == 0


def gather_tp(plan: Plan, name: str, local: torch.Tensor, comm: Communicator | None) -> torch.Tensor:
    """The full tensor of parameter ``name`` from every tensor-parallel rank's shard (collective)."""
    placement = plan.placements.get(name)
    if placement is None or not placement.is_split or plan.tp == 1:
        return local.detach().clone()
    parts = comm.all_gather(local.detach())[::placement.replicas]  # one copy of each chunk
    size = local.shape[placement.dim] * len(parts)
    return assemble(parts, placement.dim, segments_or_whole(placement.segments, size))


class ParallelModule(Checkpointing, nn.Module):
    """This rank's piece of a tensor-parallel model; computes what the original model computes.

    It holds the model's train-mode and eval-mode graphs (sharing one set of shards): ``train()`` and
    ``eval()`` switch dropout and any other mode-dependent op exactly as on the original model.
    With ``dp`` (data parallelism), ``comm`` is the tensor-parallel group and this module is one replica;
    under fsdp both graphs run through one FSDP unit (``fsdp_unit``) that shards their parameters over dp.
    """

    def __init__(self, graphs: dict[bool, fx.GraphModule], plan: Plan, comm: Communicator | None,
                 names: StateNames, stream: RankStream, inputs: InputSpec, training: bool,
                 dp: DataParallel | None = None, compile: bool = False):
        super().__init__()
        self.module, self.eval_module = graphs[True], graphs[False]
        self.plan, self.comm = plan, comm
        self.rank = comm.rank if comm is not None else 0
        self._names, self._stream, self._inputs = names, stream, inputs
        self._dp = dp
        self.fsdp_unit = dp.wrap(self.module, self.eval_module) if dp is not None else None
        self._output_gathers = output_gathers([self.module, self.eval_module])
        # A plain dict, so the compiled wrappers are not submodules (their parameters are the graphs').
        self._compiled = {mode: torch.compile(gm) for mode, gm in graphs.items()} if compile else None
        for gather in self._output_gathers if compile else ():
            gather.overwritable = False  # a compiled graph may keep its outputs for its own backward
        self.generation = None
        """``runtime.generation.Generation``, set by ``parallelize``: what ``generate`` needs of the model."""
        self.train(training)
        close_at_exit(self)

    @property
    def dp_rank(self) -> int:
        """This replica's index among the data-parallel replicas: feed it slice ``dp_rank`` of the global batch."""
        return self._dp.rank if self._dp is not None else 0

    @property
    def dp_size(self) -> int:
        """The number of data-parallel replicas (1 without data parallelism)."""
        return self._dp.size if self._dp is not None else 1

    def _graph(self) -> nn.Module:
        if self.fsdp_unit is not None:
            return self.fsdp_unit  # FSDP's hooks unshard before, and reduce-scatter gradients after, either graph
        if self._compiled is not None:
            return self._compiled[self.training]
        return self.module if self.training else self.eval_module

    def forward(self, *inputs, **kwargs):
        """The original model's output, identical on every rank."""
        return self._inputs.run(self._graph(), inputs, kwargs)

    def step(self, *inputs, target: torch.Tensor | None = None, loss_fn: Callable | None = None,
             **kwargs) -> torch.Tensor:
        """Forward and backward on the inputs (positional or keyword, as the model takes them); returns the
        (detached) loss. Gradients land in ``parameters()``.

        The loss is ``loss_fn(output, target)`` (default: cross-entropy of the logits) when ``target`` is
        given; else the model's own (``output.loss``, which a Hugging Face model computes when the inputs
        include ``labels=``; the model must have been captured with labels among its example inputs).
        With data parallelism each replica passes its own slice of the global batch and gets its own slice's
        loss; the gradients are averaged over the replicas, so one optimizer step equals a single process's on
        the whole batch (for a mean-reduced loss over equal slices).
        """
        loss = self.loss(*inputs, target=target, loss_fn=loss_fn, **kwargs)
        loss.backward()
        self.average_gradients()
        return loss.detach()

    def loss(self, *inputs, target: torch.Tensor | None = None, loss_fn: Callable | None = None,
             **kwargs) -> torch.Tensor:
        """The forward half of ``step``: the loss it trains on (same arguments), with its graph, for a backward
        of your own. Split outputs are not gathered for it: the default cross-entropy and a model's own loss
        are computed on the vocabulary-split logits; a ``loss_fn`` gets the outputs whole."""
        with deferred(self._output_gathers) as split:
            return step_loss(self(*inputs, **kwargs), target, loss_fn, split)

    def average_gradients(self) -> None:
        """Average the gradients over the data-parallel replicas, after a backward of your own under
        ``dp_mode='replicate'`` (``step`` does it; under fsdp, FSDP's hooks do it during backward)."""
        if self._dp is not None:
            self._dp.average_gradients(self.parameters())

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the gradients as ``torch.nn.utils.clip_grad_norm_`` clips the unsharded model's; returns the
        total norm, the same on every rank (collective: every rank must call it)."""
        tp_rank, dp_counts = self.rank, self._dp.counts() if self._dp is not None else True
        pieces = [(local(p.grad), is_counted(split_param(self.plan, self._names, target, tp_rank), tp_rank, dp_counts,
                                             True))
                  for target, p in self.module.named_parameters() if p.grad is not None]
        group = self.comm.group if self._dp is None and self.comm is not None else None
        return clip_grad_norm_(pieces, max_norm, norm_type, group, distributed=self.comm is not None)

    def manual_seed(self, seed: int) -> None:
        """Restart the random stream of dropout and every other random op at ``seed`` on this rank (call it with
        the same seed on every rank): the masks are then those a single process draws after
        ``torch.manual_seed(seed)``, and so are ``generate``'s samples."""
        self._stream.manual_seed(seed)
        if self.generation is not None:
            self.generation.manual_seed(seed)

    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
                 max_new_tokens: int | None = None, do_sample: bool | None = None, temperature: float | None = None,
                 top_k: int | None = None, top_p: float | None = None, eos_token_id=None,
                 pad_token_id: int | None = None, return_dict_in_generate: bool = False,
                 output_logits: bool = False):
        """What ``model.generate`` returns (the prompts followed by the new tokens), on every rank (collective).

        Arguments are Hugging Face's; unset ones come from the model's ``generation_config``, then transformers'
        defaults. Prompts are left-padded, ``attention_mask`` 0 on the padding. A model with a KV cache decodes
        with each rank holding its split of the cache (``runtime.generation``); one without re-runs the sequence
        for every token. Runs under ``torch.inference_mode()`` on the current weights, in eval mode. With
        ``return_dict_in_generate`` it returns an object with ``sequences`` (and each step's ``logits`` with
        ``output_logits``), as transformers does.
        """
        if self.generation is None:
            raise InputError("this parallel module was built without its model's structure; build it with "
                             "autotp.parallelize to generate")
        given = {"max_new_tokens": max_new_tokens, "do_sample": do_sample, "temperature": temperature,
                 "top_k": top_k, "top_p": top_p, "eos_token_id": eos_token_id, "pad_token_id": pad_token_id,
                 "return_dict_in_generate": return_dict_in_generate, "output_logits": output_logits}
        return self.generation.generate(self, input_ids, attention_mask, given)

    def local_state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's tensors (tensor-parallel shards for split parameters, whole over data-parallel
        replicas) under the original names; collective over dp under fsdp."""
        return {name: gathered(t) for name, t in self._names.local(self.module).items()}

    def _holding(self) -> Holding:
        # Over the tp group alone, or the whole world when data-parallel replicas hold the same chunks.
        group = self.comm.group if self.comm is not None and self.dp_size == 1 else None
        return holding(self.plan, self.rank, self._names.local(self.module), self._names.params(self.module),
                       self._names.extra_state, self._names.aliases, group, self.comm is not None)

    def full_state_dict(self) -> dict[str, object]:
        """Full tensors under the original model's state-dict keys, on every rank.

        A collective call: every rank of the group must make it (a rank calling it alone fails once the
        group's timeout passes, with ``RankFailure``).
        """
        full = {name: gather_tp(self.plan, name, t, self.comm) for name, t in self.local_state_dict().items()}
        return self._names.complete(full)

    def close(self) -> None:
        """Release the process group this module holds (done at exit); it cannot communicate afterwards."""
        if self.comm is not None and hasattr(self.comm, "close"):
            self.comm.close()
        if self._dp is not None:
            self._dp.mesh.close()
