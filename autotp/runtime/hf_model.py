"""A parallel module that answers like a Hugging Face ``PreTrainedModel``: ``config``, ``generation_config``,
``device``, ``dtype``, ``save_pretrained``, and a ``state_dict``/``load_state_dict`` under the original names.

``nn.Module``'s own ``state_dict`` of a parallel module lists its graphs' attributes (``module.*`` and
``eval_module.*``, every shard twice, under mangled names). Code written for the original model (a training
loop's checkpoint, ``model.load_state_dict(torch.load(...))``) expects its keys instead: here ``state_dict()``
has the original model's keys, each holding this rank's tensor (its tensor-parallel shard of a split parameter),
and ``load_state_dict`` takes either such a dict or the unsharded model's full one, cutting this rank's slices.
"""

from __future__ import annotations

import copy
import os
import re
from typing import NamedTuple

import torch
from torch.distributed.tensor import DTensor

from autotp.errors import CheckpointError, InputError, ModelPartError
from autotp.runtime.fused_head import fused_forward, is_fused_head
from autotp.passes.placement import Part, part_of
from autotp.runtime.data_parallel import dp_shard
from autotp.runtime.peft_adapters import load_adapter, merge_adapters, save_adapters
from autotp.runtime.peft_habits import PeftHabits, unsupported_peft
from autotp.runtime.reference_model import ReferenceModel, reference_model
from autotp.runtime.tp_params import plain

DEFAULT_SHARD_SIZE = "50GB"
"""``save_pretrained``'s default ``max_shard_size`` (transformers 5's)."""

_SAVE_NEUTRAL = {"is_main_process": None, "push_to_hub": False, "variant": None, "safe_serialization": True,
                 "save_peft_format": True, "save_original_format": True, "distributed_checkpoint": False,
                 "token": None}
"""``PreTrainedModel.save_pretrained`` arguments and the values that change nothing here (the first rank writes
whatever ``is_main_process`` says: every rank must call it)."""


class IncompatibleKeys(NamedTuple):
    """What ``load_state_dict`` returns, as ``nn.Module.load_state_dict`` names it."""

    missing_keys: list[str]
    unexpected_keys: list[str]


def shard_bytes(size) -> int:
    """``max_shard_size`` in bytes: an int, or a string as transformers takes it ("5GB", "500MB", "10GiB")."""
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(I?B)\s*", str(size).upper())
    if match is None:
        raise InputError(f"max_shard_size must be a positive number of bytes or a size such as '5GB', got {size!r}")
    number, prefix, unit = match.groups()
    base = 1024 if unit == "IB" else 1000
    return int(float(number) * base ** "_KMGT".index(prefix or "_"))


def slice_for(name: str, value, part: Part, own: torch.Tensor) -> torch.Tensor:
    """The values to copy into ``own`` (this rank's tensor of parameter ``name``, which holds ``part`` of it) from
    ``value``: the full tensor, this rank's tensor-parallel shard, or (under fsdp) its local piece."""
    if not isinstance(value, torch.Tensor):
        raise CheckpointError(f"{name} is a {type(value).__name__} in the state dict, not a tensor")
    value = plain(value).detach()
    shape = tuple(value.shape)
    if shape == part.shape:
        value = part.take(value)
    elif shape != part.local_shape and not (isinstance(own, DTensor) and shape == tuple(plain(own).shape)):
        raise CheckpointError(f"{name} has shape {shape} in the state dict, but the model's is {part.shape} (this "
                              f"rank holds {part.local_shape} of it); load a state dict of this model")
    if isinstance(own, DTensor) and tuple(value.shape) != tuple(plain(own).shape):
        value = dp_shard(value, own)  # FSDP shards this rank's tensor over the replicas: keep the replica's piece
    return value


class PretrainedModelLike(PeftHabits):
    """What a parallel module adds to answer like a ``PreTrainedModel`` (mixed into ``ParallelBase``, which provides
    ``plan``, ``model_config``, ``rank_modules``, ``tp_rank``, ``_names`` and ``save``)."""

    generation_config = None
    """The original model's ``generation_config`` (None for a model without one); ``generate`` reads it."""

    @property
    def config(self):
        """The original model's ``config`` (a Hugging Face model's); AttributeError for a model without one."""
        if self.model_config is None:
            raise AttributeError(f"{type(self).__name__} has no config: the model passed to parallelize had none")
        return self.model_config

    def __setattr__(self, name: str, value) -> None:
        # TRL's SFTTrainer binds a fused LM head as the forward: computed here from the module's logits
        if name == "forward" and is_fused_head(value):
            value = fused_forward(self, value)
        super().__setattr__(name, value)

    def __getattr__(self, name: str):
        """``nn.Module``'s attributes, else a ``ModelPartError`` for a part of the original model (a first
        component of its parameters' names): code that drives a model's parts apart cannot drive this one."""
        try:
            return torch.nn.Module.__getattr__(self, name)
        except AttributeError:
            names = self.__dict__.get("_names")
            unsupported_peft(self, name)
            if names is None or name not in {key.split(".")[0] for key in names.shapes}:
                raise
            raise ModelPartError(
                f"autotp: the parallel module has no attribute {name!r}: it is a part of the original model, and the "
                "parallel module runs the model captured as a whole (one graph per rank), not its submodules. Call "
                "pm(...) or pm.generate(...) as a whole; code that calls a model's parts apart cannot drive it "
                "(TRL's SFTTrainer is handled: its fused LM head is computed from pm's logits)") from None

    @property
    def device(self) -> torch.device:
        """The device this rank's parameters are on (as ``PreTrainedModel.device``)."""
        return next(p.device for p in self.parameters())

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of this rank's first floating-point parameter (as ``PreTrainedModel.dtype``)."""
        return next(p.dtype for p in self.parameters() if p.is_floating_point())

    def _holders(self) -> dict[str, list[torch.Tensor]]:
        """This rank's tensors under their kept (original) names: one per name, or one per stage holding it (a
        tied weight read by two of this rank's pipeline stages); both modes' graphs share them."""
        self._adapters_on("reading or loading the state")
        held: dict[str, list[torch.Tensor]] = {}
        for module in self.rank_modules():
            for target, t in module.state_dict(keep_vars=True).items():
                if not target.startswith("autotp_"):
                    held.setdefault(self._names.param_name(target), []).append(t)
        return held

    def _part(self, name: str, tensor: torch.Tensor) -> Part:
        """The part of the full tensor ``name`` this rank's ``tensor`` is."""
        placement = self.plan.placements.get(name)
        split = placement is not None and placement.is_split
        shape = self._names.shapes[name] if split else tuple(tensor.shape)  # an FSDP DTensor's: whole over dp
        return part_of(placement, shape, self.tp_rank, self.plan.tp)

    def state_dict(self, *args, destination=None, prefix: str = "", keep_vars: bool = False):
        """The original model's state-dict keys that this rank holds, each with this rank's tensor (its shard of a
        split parameter), tied names sharing one tensor as in the original; no communication. ``full_state_dict``
        gathers the full tensors instead."""
        if args:
            raise InputError("pass state_dict's arguments by name (destination=, prefix=, keep_vars=)")
        out = destination if destination is not None else {}
        own = {k: (ts[0] if keep_vars else plain(ts[0]).detach()) for k, ts in self._holders().items()}
        for key in self._names.state_keys:
            kept = self._names.aliases.get(key, key)
            if kept in own:
                out[prefix + key] = own[kept]
            elif key in self._names.extra_state:
                out[prefix + key] = self._names.extra_state[key]
        return out

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False) -> IncompatibleKeys:
        """Load the original model's full state dict (this rank takes its slices) or a ``state_dict()`` of this
        layout; returns the missing and unexpected keys (with ``strict``, raises ``CheckpointError`` on any).
        Every value is checked before any is copied."""
        if assign:
            raise InputError("load_state_dict(assign=True) would replace this rank's shards by the given tensors; "
                             "leave assign out: the values are copied into this rank's slices")
        copies, missing = self._copies(state_dict)
        known = set(self._names.state_keys)
        unexpected = [k for k in state_dict if k not in known]
        if strict and (missing or unexpected):
            raise CheckpointError(f"load_state_dict: missing keys {missing[:5]}, unexpected keys {unexpected[:5]}; "
                                  "pass the original model's state dict (or pm.state_dict()), or strict=False")
        with torch.no_grad():
            for target, value in copies:
                target.copy_(value)
        return IncompatibleKeys(missing, unexpected)

    def _copies(self, state_dict) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], list[str]]:
        """(this rank's tensor, the values to copy into it) for every tensor this rank holds, checked, and the keys
        of those the state dict lacks."""
        names, own = self._names, self._holders()
        keys_of: dict[str, list[str]] = {}
        for key in names.state_keys:
            keys_of.setdefault(names.aliases.get(key, key), []).append(key)
        copies, missing = [], []
        for kept, keys in keys_of.items():
            given = next((k for k in keys if k in state_dict), None)
            if kept in own:  # tied names share one tensor: any of them gives its value
                if given is None:
                    missing += keys
                else:
                    value = slice_for(given, state_dict[given], self._part(kept, own[kept][0]), own[kept][0])
                    copies += [(plain(t), value) for t in own[kept]]
                continue
            for key in keys:  # state the graph never reads, kept whole on every rank (none: another stage's)
                value = names.extra_state.get(key)
                if not isinstance(value, torch.Tensor):
                    continue
                if key not in state_dict:
                    missing.append(key)
                else:
                    copies.append((value, slice_for(key, state_dict[key], Part(tuple(value.shape)), value)))
        return copies, missing

    def _export_configs(self) -> list:
        """What an export writes beside the tensors: the config (its ``dtype`` and ``architectures`` set on a
        copy, as ``save_pretrained`` sets them) and the generation config."""
        configs = []
        if self.model_config is not None and hasattr(self.model_config, "save_pretrained"):
            config = copy.deepcopy(self.model_config)
            config.dtype = str(self.dtype).split(".")[1]
            config.architectures = [self.plan.model] if self.plan.model else getattr(config, "architectures", None)
            configs.append(config)
        if self.generation_config is not None and hasattr(self.generation_config, "save_pretrained"):
            configs.append(self.generation_config)
        return configs

    def save_pretrained(self, save_directory: str | os.PathLike, *, state_dict=None,
                        max_shard_size: int | str = DEFAULT_SHARD_SIZE, **kwargs) -> None:
        """Write what the unsharded model's ``save_pretrained`` writes (``config.json``, ``generation_config.json``,
        ``model.safetensors`` or shards of at most ``max_shard_size`` with their index), full tensors gathered and
        written by the first rank: ``from_pretrained(save_directory)`` loads it. A collective call, made by every
        rank. ``save_directory`` is replaced as a whole (see ``save``). A peft model writes its adapters instead, as
        ``PeftModel.save_pretrained`` does (``adapter_config.json``, ``adapter_model.safetensors``), which
        ``PeftModel.from_pretrained(base, save_directory)`` loads."""
        if getattr(self, "peft", None) is not None and state_dict is None and not kwargs:
            save_adapters(self, save_directory, self.peft)  # a peft model saves its adapters, as peft does
            return
        if state_dict is not None:
            raise InputError("save_pretrained gathers the full tensors itself; leave state_dict= out")
        for name, value in kwargs.items():
            if name not in _SAVE_NEUTRAL:
                raise InputError(f"save_pretrained does not take {name}=; it takes max_shard_size= (and "
                                 f"{', '.join(_SAVE_NEUTRAL)} at their defaults)")
            if name != "is_main_process" and value != _SAVE_NEUTRAL[name]:
                raise InputError(f"save_pretrained({name}={value!r}) is not supported: autotp writes safetensors "
                                 f"locally; leave {name} at {_SAVE_NEUTRAL[name]!r}")
        self.save(save_directory, format="safetensors", max_shard_bytes=shard_bytes(max_shard_size))

    def load_adapter(self, model_id: str | os.PathLike, adapter_name: str = "default", is_trainable: bool = False,
                     **kwargs) -> None:
        """Load a LoRA adapter that ``PeftModel.save_pretrained`` (or ``save_pretrained`` here, at any tp) wrote
        into this peft model's adapter ``adapter_name`` (one it had at ``parallelize``): every rank takes its
        slices. As peft's ``load_adapter``, the module is then in eval mode unless ``is_trainable``."""
        info = self._peft_info("load_adapter")
        if adapter_name not in info.configs:
            raise InputError(f"load_adapter(adapter_name={adapter_name!r}): this parallel module has adapters "
                             f"{sorted(info.configs)}; peft would add a new one, but the module's graph is fixed at "
                             "parallelize. Load it into an adapter it has (adapter_name="
                             f"{self.active_adapters[0]!r}), or add it to the peft model before autotp.parallelize")
        if kwargs:
            raise InputError(f"load_adapter takes model_id, adapter_name and is_trainable here, not {sorted(kwargs)}")
        load_adapter(self, model_id, adapter_name)
        if not is_trainable:
            self.eval()  # as peft's load_adapter: ready for inference

    def reference_model(self) -> ReferenceModel:
        """This module frozen as it is now, for preference training (TRL's
        ``DPOTrainer(ref_model=pm.reference_model())``): it runs this module's graphs on copies of its trainable
        tensors (the adapters' shards), sharing the frozen base (``runtime.reference_model``)."""
        return reference_model(self)

    def merge_adapters(self, adapter_name: str = "default") -> None:
        """Fold the LoRA adapter into the sharded base weights (``merge_and_unload``'s ``W + s * B @ A``), locally
        on every rank, and zero its ``B``: the module then computes what the merged model computes."""
        merge_adapters(self, self._peft_info("merge_adapters"), adapter_name)
