"""transformers' ``Trainer`` and accelerate's ``Accelerator`` on a parallel module: what they read, what they pass.

Both were written for a model that is either whole on every rank (then they wrap it in DistributedDataParallel
over all ranks and give every rank its own batch) or already sharded by transformers (then they leave it alone,
and give the ranks of one tensor-parallel group one batch). A parallel module is the second kind, so it answers
as such a model does:

- ``pm.tp_size`` and ``pm.config.distributed_config`` (``tp_size``, ``dp_size``): on GPUs ``Trainer`` reads them
  and builds accelerate's ``ParallelismConfig(tp_size, dp_shard_size)`` itself; on CPU ranks (where ``tp_size``
  is None, accelerate refusing that config there) pass it ``parallelism_config(pm)`` (``TrainingArguments(parallelism_config=...)``, ``Accelerator(parallelism_config=...)``),
  which accelerate 1.15 also accepts on CPU ranks. accelerate then skips its DDP wrap and shards the data by
  data-parallel rank (global rank // tp): the tp ranks of a replica read one batch, replicas different ones.
- ``pm.forward`` answers ``inspect.signature`` with the original model's forward (``Trainer`` keeps only the
  dataset columns it names, and passes ``num_items_in_batch`` when it takes ``**kwargs``), and ``pm.loss_type``
  is the model's (Trainer counts a causal LM's label tokens after the shift).
- Hugging Face's keyword arguments (``HFCall``): ``num_items_in_batch`` is honoured exactly when the module was
  captured with it (the graph holds the model's own ``sum / num_items_in_batch``; a call without it, an
  evaluation, gets the count that makes that the batch's mean) and refused, saying how, when not;
  ``return_dict=False`` gives the output's tuple; ``use_cache``, ``output_attentions`` and
  ``output_hidden_states`` are ignored where they change nothing and refused where they would.
- Refused, saying what to do instead: wrapping a parallel module in DistributedDataParallel (what a plain
  ``Accelerator().prepare(pm)`` does: DDP would broadcast the first rank's shards over the others' and average
  gradients of different shards), at DDP's construction, and at the forward should a torch release build DDP
  without asking (``refuse_replica_ddp``).
- Data parallelism needs nothing of the loop: ``dp_mode='fsdp'`` averages gradients during backward,
  ``'replicate'`` at the end of every backward (as DDP), so accelerate's and Trainer's loops train either exactly.
- Gradient clipping (Trainer's ``max_grad_norm``, ``accelerator.clip_grad_norm_``) is torch's
  ``clip_grad_norm_`` over the DTensor parameters (``runtime.tp_params``): the global norm over shards and replicas.
"""

from __future__ import annotations

import copy
import inspect
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from autotp.capture import Signature
from autotp.torch_private import active_ddp_module
from autotp.errors import InputError, RuntimeSetupError
from autotp.options import Options
from autotp.runtime.trl_reference import check_reference

ITEMS = "num_items_in_batch"
"""The keyword Trainer passes so that a loss is normalised over the whole accumulated global batch."""

_IGNORED_WHEN_AS_CAPTURED = ("use_cache", "output_attentions", "output_hidden_states")
"""Keywords that change only which extra outputs a Hugging Face model returns: ignored when they ask for what the
capture computed (the model's config value, or None) or for less cache (``use_cache=False``: the output may still
carry it), refused when they ask for outputs the graph does not compute."""


@dataclass(frozen=True)
class DistributedLayout:
    """A parallel module's layout, as transformers' ``DistributedConfig`` states a sharded model's (what
    ``Trainer`` reads from ``model.config.distributed_config``, and accelerate's ``get_model_tp_size``)."""

    tp_size: int
    dp_replicate_size: int
    """The data-parallel replicas (each reads its own slice of the global batch)."""
    fsdp_size: int = 1
    pp_size: int = 1

    @property
    def dp_size(self) -> int:
        """The number of ranks that each read a distinct batch (transformers' ``dp_replicate_size * fsdp_size``)."""
        return self.dp_replicate_size * self.fsdp_size


def rank_config(config, options: Options):
    """A copy of the model's ``config`` carrying the module's ``distributed_config``, or None without a config.

    A copy: the user's model keeps its own config untouched. transformers drops ``distributed_config`` when it
    writes a config (``to_dict``), so exports are unchanged.
    """
    if config is None:
        return None
    mine = copy.copy(config)
    try:
        mine.distributed_config = DistributedLayout(options.tp, options.dp, pp_size=options.pp)
    except (AttributeError, TypeError):  # a frozen or slotted config: Trainer then builds no ParallelismConfig
        return config
    return mine


@dataclass(frozen=True)
class LayoutOnly:
    """The ``config`` of a parallel module whose model has none: only its ``distributed_config``."""

    distributed_config: DistributedLayout


def facing(pm, model):
    """``pm``, answering what Trainer reads of ``model`` besides its config: ``loss_type`` (a causal LM's loss
    shifts the labels, so Trainer counts ``num_items_in_batch`` over ``labels[..., 1:]``)."""
    pm.loss_type = getattr(model, "loss_type", None)
    return pm


class RefusesDDP:
    """A parallel module (of any kind) refuses to be wrapped in DistributedDataParallel."""

    @property
    def _ddp_params_and_buffers_to_ignore(self):
        # DistributedDataParallel reads this attribute first thing in its constructor (torch 2.13; the only reader
        # in torch, accelerate and transformers): refusing here stops a wrap before it broadcasts the first rank's
        # shards over the others'. Checked by test_trainer; the forward's check remains for a torch that stops.
        raise RuntimeSetupError(f"a parallel module cannot be wrapped in DistributedDataParallel: DDP would copy "
                                f"the first rank's shards over the others' and average gradients of different "
                                f"shards. {_INSTEAD}")


class TrainerFacing(RefusesDDP):
    """What Trainer and accelerate read of a model, answered by a parallel module (a mixin of ``ParallelModule``,
    which provides ``options``, ``model_config`` and ``_inputs``)."""

    _loss_kwargs: bool | None = None
    loss_type: str | None = None
    """The original model's ``loss_type`` (``facing``)."""

    def add_model_tags(self, tags: list[str] | str) -> None:
        """Tags for a model card, as ``PreTrainedModel.add_model_tags`` keeps them (TRL's trainers add theirs, and
        a preference trainer's reference is checked then: ``runtime.trl_reference``)."""
        # The caller's frame is the TRL trainer's __init__: its ref_model argument and args say which reference it
        # will use, which nothing it passes to the model does (sys._getframe: CPython's, kept since 2.x).
        check_reference(self, sys._getframe(1).f_locals)
        held = list(self.__dict__.get("model_tags") or [])
        self.model_tags = held + [t for t in ([tags] if isinstance(tags, str) else tags) if t not in held]

    @property
    def tp_size(self) -> int | None:
        """The tensor-parallel degree, as transformers' ``model.tp_size``: Trainer builds accelerate's
        ``ParallelismConfig`` from it. None on CPU ranks, where accelerate refuses that config: Trainer then wraps
        the module in DDP, which it refuses, naming ``autotp.parallelism_config`` (accelerate reads the degree
        from ``config.distributed_config`` then)."""
        if any(p.device.type == "cpu" for p in self.parameters()):
            return None
        return self.options.tp

    @property
    def config(self):
        """The original model's config (a copy carrying ``distributed_config``, the layout Trainer reads)."""
        if self.model_config is not None:
            return self.model_config
        return LayoutOnly(DistributedLayout(self.options.tp, self.options.dp, pp_size=self.options.pp))

    @property
    def accepts_loss_kwargs(self) -> bool:
        """Whether Trainer passes ``num_items_in_batch`` (as it would to the original model, whose forward takes
        ``**kwargs``). Set it False to have Trainer train on each batch's mean loss instead (a module captured
        without ``num_items_in_batch`` refuses it)."""
        if self._loss_kwargs is not None:
            return self._loss_kwargs
        return ITEMS in self._inputs.names or self._inputs.signature.var_keyword

    @accepts_loss_kwargs.setter
    def accepts_loss_kwargs(self, value: bool) -> None:
        """Whether Trainer passes ``num_items_in_batch`` from now on."""
        self._loss_kwargs = bool(value)

    def _hf_call(self, kwargs: dict) -> HFCall:
        """A forward's keyword arguments sorted (``HFCall``), after refusing a DDP wrap over this replica."""
        refuse_replica_ddp(self.comm)
        return self._hf_sorted(kwargs)

    def _hf_sorted(self, kwargs: dict) -> HFCall:
        """The keyword arguments of a call (a forward, a step) sorted (``HFCall``)."""
        self._check_adapters_off()  # pm.step and pm.loss do not run the forward's hooks
        if not kwargs:
            return HFCall(kwargs)
        return HFCall.of(kwargs, self._inputs.names, self._inputs.dtypes, self.model_config,
                         lambda: "set pm.accepts_loss_kwargs = False before building the Trainer", self.loss_type)


def parallelism_config(pm):
    """accelerate's ``ParallelismConfig`` for ``pm``: build the ``Accelerator`` with it
    (``Accelerator(parallelism_config=autotp.parallelism_config(pm))``, or pass it to ``TrainingArguments``) so
    that ``prepare`` leaves ``pm`` unwrapped and gives each data-parallel replica its own batches, the
    tensor-parallel ranks of a replica the same ones.

    ``Trainer(model=pm)`` builds the same by itself on GPUs (``tp_size``, and ``dp_shard_size`` for the replicas:
    to accelerate that names only how the data is sharded; ``pm`` averages gradients over its replicas itself).
    accelerate 1.15 accepts tensor parallelism only on accelerators; this config also accepts CPU ranks (gloo),
    where accelerate's handling of a tensor-parallel model is the same.
    """
    if pm.options.pp > 1:
        raise InputError(f"accelerate has no pipeline parallelism (this module has pp={pm.options.pp}): train it with "
                         "pm.step in your own loop, or parallelize with pp=1 for accelerate and Trainer")
    return _config_class()(tp_size=pm.options.tp, dp_shard_size=pm.dp_size)


def _config_class():
    """accelerate's ``ParallelismConfig``, accepting CPU ranks too (accelerate asks for an accelerator only because
    its own tensor parallelism shards on one; a parallel module is sharded already)."""
    from accelerate import ParallelismConfig
    from accelerate.utils import DistributedType

    class AutotpParallelism(ParallelismConfig):
        """``ParallelismConfig`` of a parallel module (``autotp.parallelism_config``)."""

        def _validate_accelerator(self, accelerator) -> None:
            if accelerator.distributed_type is not DistributedType.MULTI_CPU:
                return super()._validate_accelerator(accelerator)
            if self.total_size != accelerator.num_processes:
                raise RuntimeSetupError(f"the parallel module spans {self.total_size} ranks (tp={self.tp_size} x "
                                        f"dp={self.dp_shard_size}) but accelerate runs {accelerator.num_processes} "
                                        "processes: launch as many as the module's world size")
            return None

    return AutotpParallelism


def forward_signature(signature: Signature) -> inspect.Signature:
    """The original forward's parameters as ``inspect.Signature`` (what Trainer inspects to choose columns)."""
    kinds, params, defaulted = inspect.Parameter, [], False
    for name in signature.positional:
        defaulted = defaulted or name in signature.none_default
        params.append(kinds(name, kinds.POSITIONAL_OR_KEYWORD, default=None if defaulted else kinds.empty))
    if signature.var_positional:
        params.append(kinds("args", kinds.VAR_POSITIONAL))
    for name in sorted(signature.keywords - set(signature.positional)):
        params.append(kinds(name, kinds.KEYWORD_ONLY, default=None if name in signature.none_default else kinds.empty))
    if signature.var_keyword:
        params.append(kinds("kwargs", kinds.VAR_KEYWORD))
    return inspect.Signature(params)


class _BoundForward:
    """``pm.forward``: calls the module's forward, and has the original model's signature."""

    def __init__(self, function: Callable, module):
        self.__func__, self.__self__ = function, module

    def __call__(self, *args, **kwargs):
        return self.__func__(self.__self__, *args, **kwargs)

    @property
    def __signature__(self) -> inspect.Signature:
        return forward_signature(self.__self__._inputs.signature)

    @property
    def __doc__(self):
        return self.__func__.__doc__


class signed_forward:  # noqa: N801 (used as a decorator, like property)
    """Decorates a parallel module's ``forward`` so that ``inspect.signature(pm.forward)`` is the captured model's:
    a method's signature is its class's function's, the same for every instance, so ``forward`` is a descriptor
    that binds a callable carrying the instance's signature."""

    def __init__(self, function: Callable):
        self.function = function
        self.__doc__ = function.__doc__

    def __get__(self, module, owner=None):
        return self.function if module is None else _BoundForward(self.function, module)


@dataclass(frozen=True)
class HFCall:
    """One forward call's keyword arguments sorted: those for the graph, and how its output is returned."""

    kwargs: dict
    as_tuple: bool = False
    """``return_dict=False``: the output as the tuple a Hugging Face model returns."""

    @classmethod
    def of(cls, kwargs: dict, names: tuple[str, ...], dtypes: tuple[torch.dtype, ...], config,
           accepts: Callable[[], str], loss_type: str | None = None) -> HFCall:
        """Sort ``kwargs`` for a module captured with inputs ``names`` (of ``dtypes``) from a model with
        ``config`` and ``loss_type``; ``accepts()`` names how to stop Trainer passing ``num_items_in_batch``."""
        kwargs, as_tuple = dict(kwargs), False
        if kwargs.get(ITEMS) is not None:
            kwargs[ITEMS] = _items(kwargs[ITEMS], names, dtypes, accepts)
        elif ITEMS in names and kwargs.get("labels") is not None:
            # Not given (an evaluation, a call of one's own): the count that makes the loss the batch's mean, as
            # the model computes it without the keyword.
            kwargs[ITEMS] = counted_items(kwargs["labels"], loss_type, config).to(dtypes[names.index(ITEMS)])
        if "return_dict" in kwargs and "return_dict" not in names:
            as_tuple = kwargs.pop("return_dict") is False
        for name in _IGNORED_WHEN_AS_CAPTURED:
            if name in kwargs and name not in names:
                _check_as_captured(name, kwargs.pop(name), config)
        return cls(kwargs, as_tuple)

    def finish(self, output):
        """The graph's output as the call asked for it."""
        if self.as_tuple and hasattr(output, "to_tuple"):
            return output.to_tuple()
        return output


def _items(value, names: tuple[str, ...], dtypes: tuple[torch.dtype, ...], accepts: Callable[[], str]):
    """``num_items_in_batch`` for the graph, in the dtype it was captured with (Trainer passes a count, divided
    by tp as a float under tensor parallelism); refused when the graph does not take it."""
    if ITEMS not in names:
        raise InputError(f"{ITEMS} was passed (Trainer passes it to normalise the loss over the whole accumulated "
                         "batch, as the unsharded model's loss does), but this module was captured without it, so "
                         "its loss is each batch's mean: capture with it among the example inputs, e.g. "
                         f"example_inputs={{'input_ids': ids, 'labels': ids, '{ITEMS}': torch.tensor(1.0)}}; or, to "
                         f"train on each batch's mean loss instead, {accepts()}")
    dtype = dtypes[names.index(ITEMS)]
    return torch.as_tensor(value).to(dtype) if isinstance(value, (torch.Tensor, int, float)) else value


def counted_items(labels: torch.Tensor, loss_type: str | None, config) -> torch.Tensor:
    """The label tokens a Hugging Face loss averages over (not -100; a decoder's causal LM loss shifts the labels
    first): Trainer's own count for ``num_items_in_batch``, with which ``sum / num_items_in_batch`` is the mean."""
    from transformers.loss.loss_utils import LOSS_MAPPING, ForCausalLMLoss

    shifts = LOSS_MAPPING.get(loss_type) is ForCausalLMLoss and not getattr(config, "is_encoder_decoder", False)
    return ((labels[..., 1:] if shifts else labels) != -100).sum()


def _check_as_captured(name: str, value, config) -> None:
    captured = getattr(config, name, None) if config is not None else None
    # use_cache=False (common in training loops) only drops the cache from the output: loss and logits are the same
    if value is None or value == captured or (not value and (not captured or name == "use_cache")):
        return
    raise InputError(f"{name}={value!r} asks for other outputs than the module was captured with ({name}="
                     f"{captured!r}, from the model's config): the graph is fixed at capture; set config.{name}="
                     f"{value!r} on the model before autotp.parallelize, or leave {name} out")


_INSTEAD = ("Do not wrap it in DDP (it averages gradients over its data-parallel replicas itself: parallelize with "
            "dp=). With accelerate, build the Accelerator with parallelism_config=autotp.parallelism_config(pm) "
            "(before prepare), which leaves it unwrapped and gives the tensor-parallel ranks of a replica one batch; "
            "with Trainer pass TrainingArguments(parallelism_config=autotp.parallelism_config(pm)) (on GPUs "
            "Trainer(model=pm) builds it by itself)")


def refuse_replica_ddp(comm) -> None:
    """Refuse a forward run by DistributedDataParallel over ranks that hold different pieces of one model
    replica (``comm``: its tensor-parallel communicator; None: one process): DDP broadcast the first rank's
    shards over the others' when it was built, and averages gradients of different shards."""
    ddp = active_ddp_module()
    if ddp is None or not hasattr(comm, "group"):
        return
    wrapped = dist.get_process_group_ranks(ddp.process_group)
    replica = dist.get_process_group_ranks(comm.group if comm.group is not None else dist.group.WORLD)
    shared = sorted(set(wrapped) & set(replica))
    if len(shared) < 2:
        return  # DDP over the data-parallel replicas alone: each rank's peers hold the same pieces
    raise RuntimeSetupError(
        f"this parallel module is wrapped in DistributedDataParallel over ranks {wrapped}, which include its "
        f"tensor-parallel ranks {shared}: DDP copied the first rank's shards over the others' and would average "
        f"gradients of different shards. {_INSTEAD}")

