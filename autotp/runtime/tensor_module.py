"""The tensor-parallel module a user trains: one rank's rewritten train- and eval-mode graphs (which share one set
of shards), run eagerly, under FSDP or under ``torch.compile``. What it shares with every parallel module is in
``parallel_base``; the state-dict bookkeeping in ``state``."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import fx, nn

from autotp.errors import InputError
from autotp.rewrite.grad_bucket import grad_buckets
from autotp.runtime.batch_agreement import inputs_started
from autotp.runtime.data_parallel import local
from autotp.runtime.drift import Fingerprints
from autotp.runtime.generation import Generation, rank_tensors
from autotp.runtime.integrations import TrainerFacing, signed_forward
from autotp.runtime.loss import LossGraphs, checked_loss, step_loss
from autotp.runtime.outputs import deferred, output_gathers
from autotp.runtime.parallel_base import ParallelBase, RankParts, checked_scale
from autotp.runtime.peers import guarded
from autotp.runtime.sampling import check_extra


class ParallelModule(TrainerFacing, ParallelBase):
    """This rank's piece of a tensor-parallel model; computes what the original model computes.

    It holds the model's train-mode and eval-mode graphs (sharing one set of shards): ``train()`` and
    ``eval()`` switch dropout and any other mode-dependent op exactly as on the original model.
    With data parallelism, ``comm`` is the tensor-parallel group and this module is one replica;
    under fsdp both graphs run through one FSDP unit (``fsdp_unit``) that shards their parameters over dp.
    """

    def __init__(self, parts: RankParts, graphs: dict[bool, fx.GraphModule], generation: Generation | None = None,
                 loss_graphs: LossGraphs | None = None):
        super().__init__(parts)
        self.generation = generation
        """What ``generate`` needs of the model (``runtime.generation``); None: this module cannot generate."""
        self.loss_graphs = loss_graphs
        """The model captured with each ``loss_fn`` (``runtime.loss``); None: a loss_fn gets gathered outputs."""
        self.module, self.eval_module = graphs[True], graphs[False]
        self.fsdp_unit = self._dp.wrap(self.module, self.eval_module) if self._dp is not None else None
        self._output_gathers = output_gathers([self.module, self.eval_module])
        # A plain dict, so the compiled wrappers are not submodules (their parameters are the graphs').
        compiled = parts.options.compile
        self._compiled = {mode: torch.compile(gm) for mode, gm in graphs.items()} if compiled else None
        for gather in self._output_gathers if compiled else ():
            gather.overwritable = False  # a compiled graph may keep its outputs for its own backward
        if self._dp is not None:
            self._dp.average_in_backward(self.parameters())  # replicate: as DDP, at the end of every backward
            self._dp.take_buckets(grad_buckets([self.module, self.eval_module]), pipelined=False,
                                  modules=[self.module])
        self._replicated = self._fingerprints()
        self._start(parts.training)

    def _fingerprints(self) -> Fingerprints:
        """The drift fingerprints of this rank's replicated parameters (``drift``); none in one process."""
        return Fingerprints(self._replicated_params() if self.comm is not None else {})

    def _apply(self, fn, recurse=True):
        result = super()._apply(fn, recurse)
        if hasattr(self, "_replicated"):
            # A cast or move (pm.to) gives the parameters new tensors (swapped into DTensors, or set as .data):
            # fingerprints of the old ones would sample values that never change again, and drift would pass unseen.
            self._replicated = self._fingerprints()
        return result

    def _replicated_params(self) -> dict[str, torch.Tensor]:
        """This rank's stored piece of every parameter all tp ranks hold whole, by original name (``drift``)."""
        out = {}
        for target, p in self.module.named_parameters():
            name = self._names.param_name(target)
            placement = self.plan.placements.get(self._names.aliases.get(name, name))
            if (placement is None or not placement.is_split) and local(p).numel():
                out[name] = local(p).detach()
        return out

    @property
    def rank(self) -> int:
        """This rank's index among the tensor-parallel ranks."""
        return self.tp_rank

    def rank_modules(self) -> list[fx.GraphModule]:
        """The train-mode graph (the eval-mode graph shares its tensors)."""
        return [self.module]

    def _norm_group(self):
        # Without replicas the norm is over the tensor-parallel group alone; with them, over the world.
        return self.comm.group if self._dp is None and self.comm is not None else None

    def _checkpoint_group(self):
        # Over the tp group alone, or the whole world when data-parallel replicas hold the same chunks.
        return self.comm.group if self.comm is not None and self.dp_size == 1 else None

    def _graph(self) -> nn.Module:
        if self.fsdp_unit is not None:
            return self.fsdp_unit  # FSDP's hooks unshard before, and reduce-scatter gradients after, either graph
        if self._compiled is not None:
            return self._compiled[self.training]
        return self.module if self.training else self.eval_module

    @signed_forward
    def forward(self, *inputs, **kwargs):
        """The original model's output, identical on every rank (Hugging Face's keyword arguments as
        ``runtime.integrations`` says; called without the labels it was captured with, the output the model gives
        without them, where they feed its loss alone: ``runtime.labels``)."""
        call = self._hf_call(kwargs)
        return call.finish(self._run(inputs, call.kwargs, None, stand_in_labels=True))

    def _run(self, inputs: tuple, kwargs: dict, target: torch.Tensor | None, graph=None, stand_in_labels=False):
        # The tp ranks must hold one batch (and target): checked by one small all-gather begun before the graph
        # runs and completed before its first collective (the compute before it hides the all-gather's latency).
        def agree(flat):
            complete = inputs_started((*self._inputs.names, "target"), (*flat, target), self.comm,
                                      (self._replicated.names, self._replicated.digests()))
            if self._compiled is not None:
                complete()  # before a compiled graph, which must not trace the communicator's pending check
            return complete
        with guarded("forward"), self.precision_autocast():
            return self._inputs.run(graph or self._graph(), inputs, kwargs, agree, stand_in_labels)

    def step(self, *inputs, target: torch.Tensor | None = None, loss_fn: Callable | None = None,
             loss_scale: float = 1.0, **kwargs) -> torch.Tensor:
        """Forward and backward on the inputs (positional or keyword, as the model takes them); returns the
        (detached, unscaled) loss. Gradients land in ``parameters()``, added to those already there: over k
        micro-batches of gradient accumulation pass ``loss_scale=1/k`` to train on their mean (the backward is of
        ``loss * loss_scale``, as ``(loss / k).backward()`` in a loop of your own).

        The loss is ``loss_fn(output, target)`` (default: cross-entropy of the logits) when ``target`` is
        given; else the model's own (``output.loss``, which a Hugging Face model computes when the inputs
        include ``labels=``; the model must have been captured with labels among its example inputs).
        With data parallelism each replica passes its own slice of the global batch and gets its own slice's
        loss; the gradients are averaged over the replicas, so one optimizer step equals a single process's on
        the whole batch (for a mean-reduced loss over equal slices).
        """
        scale = checked_scale(loss_scale)
        with guarded("step"):
            loss = self.loss(*inputs, target=target, loss_fn=loss_fn, **kwargs)
            (loss * scale if scale != 1.0 else loss).backward()  # replicas' gradients averaged at its end
        return loss.detach()

    def close(self) -> None:
        """Release the process groups and generation's shared memory (done at exit); it cannot communicate after."""
        if self.generation is not None:
            self.generation.close()
        super().close()

    def manual_seed(self, seed: int) -> None:
        """Restart the random stream of dropout and every other random op at ``seed`` on this rank (call it with
        the same seed on every rank): the masks are then those a single process draws after
        ``torch.manual_seed(seed)``, and so are ``generate``'s samples."""
        super().manual_seed(seed)
        if self.generation is not None:
            self.generation.manual_seed(seed)

    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
                 max_new_tokens: int | None = None, do_sample: bool | None = None, temperature: float | None = None,
                 top_k: int | None = None, top_p: float | None = None, eos_token_id=None,
                 pad_token_id: int | None = None, return_dict_in_generate: bool = False,
                 output_logits: bool = False, generation_config=None, **kwargs):
        """What ``model.generate`` returns (the prompts followed by the new tokens), on every rank (collective).

        Arguments are Hugging Face's; unset ones come from the model's ``generation_config``, then transformers'
        defaults. Prompts are left-padded, ``attention_mask`` 0 on the padding. A model with a KV cache decodes
        with each rank holding its split of the cache (``runtime.generation``); one without re-runs the sequence
        for every token. Runs under ``torch.inference_mode()`` on the current weights, in eval mode. With
        ``return_dict_in_generate`` it returns an object with ``sequences`` (and each step's ``logits`` with
        ``output_logits``), as transformers does. ``generation_config`` replaces ``pm.generation_config`` for this
        call. Any other argument of transformers' ``generate`` raises ``InputError`` unless it changes nothing
        (``use_cache``, ``num_beams=1``): beam search and the other logits processors are not implemented.
        """
        check_extra(kwargs)
        if self.generation is None:
            raise InputError("this parallel module was built without its model's structure; build it with "
                             "autotp.parallelize to generate")
        given = {"max_new_tokens": max_new_tokens, "do_sample": do_sample, "temperature": temperature,
                 "top_k": top_k, "top_p": top_p, "eos_token_id": eos_token_id, "pad_token_id": pad_token_id,
                 "return_dict_in_generate": return_dict_in_generate, "output_logits": output_logits,
                 "generation_config": generation_config}
        return self.generation.generate(self, input_ids, attention_mask, given)

    def prepare_generation(self) -> None:
        """Capture and build ``generate``'s step now rather than at the first ``generate`` (a collective call:
        every rank makes it). The capture takes about as long as capturing the model once more (a second or more
        for a small Hugging Face decoder); done here, say while setting up, the first ``generate`` is as fast as
        the next. ``parallelize`` already does it for a model in eval mode captured without labels
        (``runtime.generation.for_generation``); a model in train mode captures at its first ``generate`` unless
        this is called. A model without a KV cache has nothing to capture."""
        if self.generation is None:
            raise InputError("this parallel module was built without its model's structure; build it with "
                             "autotp.parallelize to generate")
        self.generation.prepare(self)

    def loss(self, *inputs, target: torch.Tensor | None = None, loss_fn: Callable | None = None,
             **kwargs) -> torch.Tensor:
        """The forward half of ``step``: the loss it trains on (same arguments), with its graph, for a backward
        of your own. Split outputs are not gathered for it: the default cross-entropy and a model's own loss
        are computed on the vocabulary-split logits; a ``loss_fn`` is captured with the model on first use, so a
        cross-entropy inside it is too (``runtime.loss``; where it cannot be, it gets the outputs whole)."""
        kwargs = self._hf_sorted(kwargs).kwargs
        graph = self._loss_graph(loss_fn, inputs, kwargs, target)
        if graph is not None:
            return checked_loss(self._run(inputs, kwargs, target, lambda *flat: graph(*flat, target)))
        # The loss under the policy's autocast too (a cross-entropy of bf16 logits in fp32, as in the graph's)
        with deferred(self._output_gathers) as split, self.precision_autocast():
            return step_loss(self._run(inputs, kwargs, target), target, loss_fn, split)

    def _loss_graph(self, loss_fn: Callable | None, inputs: tuple, kwargs: dict, target: torch.Tensor | None):
        """The graph of the model with ``loss_fn``, or None (no loss_fn or target, or it gathers instead)."""
        if loss_fn is None or target is None or self.loss_graphs is None:
            return None
        call = (self._inputs.names, self._inputs.arrange(inputs, kwargs), target)
        return self.loss_graphs.graph(self, loss_fn, call, lambda: rank_tensors(self))
