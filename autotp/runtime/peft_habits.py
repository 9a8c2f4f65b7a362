"""What a peft user calls on a ``PeftModel``, answered by the parallel module of one: exact, or refused at the call
with what to do instead (never a method that silently does nothing).

A parallel module runs the graph captured at ``parallelize``: the adapters active then are in it, with their
``scaling`` and dropout fixed. So:

- switching the adapters off (``disable_adapter``, ``disable_adapter_layers``: TRL's DPO reference pass) swaps
  what the graphs read, not the graphs: in place of LoRA's ``B`` (and an embedding adapter's ``B``) they read a
  frozen stand-in of zeros, in place of IA3's scaling vectors one of ones, until ``enable``. ``W x + s * 0 = W x``
  exactly, so the output is the base model's, bit for bit, and the adapters get no gradient, as peft's disabled
  adapters take no part in the forward. The adapters' own parameters are never written, so a backward of a forward
  made before, and an optimizer step, see their values. Adapter kinds whose "off" is not such a value (DoRA's
  magnitude divides by a norm; a ``modules_to_save`` copy replaces the layer) are refused, naming them; so is
  reading or writing the module's state while they are off;
- the set of adapters is fixed: ``set_adapter`` to the active set is accepted, anything else (``add_adapter``,
  ``delete_adapter``, another adapter active) is refused, saying to arrange the adapters on the peft model before
  ``parallelize``;
- counting (``get_nb_trainable_parameters``, ``print_trainable_parameters``) runs peft's own count on the
  data-free copy of the peft model kept at ``parallelize`` (``PeftInfo.skeleton``), with each parameter's current
  ``requires_grad``: the unsharded model's numbers, not one rank's shards;
- gradient checkpointing is the module's ``recompute`` option, chosen at ``parallelize``;
  ``enable_input_require_grads`` changes no gradient of a parameter, so it is accepted and does nothing.
"""

from __future__ import annotations

import contextlib
import re

import torch

from autotp.errors import InputError, ModelPartError
from autotp.options import Recompute

OFF_VALUES = {"lora_B": 0.0, "lora_embedding_B": 0.0, "ia3_l": 1.0}
"""An adapter part -> the value that makes its adapter's contribution exactly nothing (``B = 0``: the low-rank
product adds zeros; IA3's vector of ones multiplies by one)."""

_UNCHANGED = ("lora_A", "lora_embedding_A")
"""Parts left as they are while the adapters are off (their product with a zero ``B`` is zero)."""

_REFUSED = {"lora_magnitude_vector": "a DoRA layer (its output is rescaled by magnitude / norm, which no value of "
                                     "its parameters turns into the base layer's)",
            "modules_to_save": "a modules_to_save copy (peft switches back to the original layer, which the "
                               "captured graph does not read)"}

_FIXED_ADAPTERS = ("the parallel module computes the adapters active when it was parallelized ({active}); its graph "
                   "is fixed then. Arrange the adapters on the peft model (get_peft_model, add_adapter, load_adapter, "
                   "set_adapter, delete_adapter) before autotp.parallelize; to put other weights into an active "
                   "adapter use pm.load_adapter(folder, adapter_name={first!r})")


def adapter_part(key: str, adapters) -> tuple[str, str] | None:
    """(part, adapter) of a state-dict key of one of ``adapters`` (``...q_proj.lora_B.default.weight`` ->
    ``("lora_B", "default")``), or None for a key of no adapter."""
    for adapter in adapters:
        match = re.search(rf"\.([A-Za-z_0-9]+)\.{re.escape(adapter)}(\.|$)", key)
        if match is not None:
            return match.group(1), adapter
    return None


def off_plan(keys, adapters) -> dict[str, float]:
    """Key -> the value it takes while ``adapters`` are off, for every adapter tensor among ``keys`` that changes;
    ``InputError`` for a part with no such value (DoRA, ``modules_to_save``, a kind not known here)."""
    plan = {}
    for key in keys:
        found = adapter_part(key, adapters)
        if found is None or found[0] in _UNCHANGED:
            continue
        part, adapter = found
        if part in OFF_VALUES:
            plan[key] = OFF_VALUES[part]
            continue
        what = _REFUSED.get(part, f"a {part!r} adapter part, which autotp does not know how to switch off")
        raise InputError(f"disable_adapter: {key} belongs to {what}, so the parallel module cannot compute the base "
                         f"model's output by switching adapter {adapter!r} off. Compare against a parallel module "
                         "of the base model (autotp.parallelize(base, ...)), or use LoRA/IA3 adapters without it")
    return plan


class PeftHabits:
    """peft's ``PeftModel`` methods on a parallel module (mixed into ``PretrainedModelLike``, which provides
    ``peft``, ``options``, ``training``, ``_holders`` and ``register_forward_pre_hook``)."""

    def _peft_info(self, what: str):
        if getattr(self, "peft", None) is None:
            raise InputError(f"{what} needs a peft model: parallelize the model peft.get_peft_model returned")
        return self.peft

    # What the adapters are.
    @property
    def active_adapters(self) -> list[str]:
        """The adapters the module computes (those active when it was parallelized), as peft's
        ``active_adapters``."""
        if getattr(self, "peft", None) is None:
            raise AttributeError("active_adapters: this parallel module's model was not a peft model")
        return list(self.peft.skeleton.active_adapters)

    @property
    def active_adapter(self) -> str | list[str]:
        """peft's ``active_adapter``: the active adapter's name (a list when several are active)."""
        active = self.active_adapters
        return active[0] if len(active) == 1 else active

    def set_adapter(self, adapter_name: str | list[str]) -> None:
        """Accepted when it names the adapters already active (nothing changes); else ``InputError``: the active
        adapters are those captured at ``parallelize``."""
        wanted = [adapter_name] if isinstance(adapter_name, str) else list(adapter_name)
        active = self.active_adapters
        if sorted(wanted) != sorted(active):
            raise InputError(f"set_adapter({adapter_name!r}): " + _fixed(active))

    def add_adapter(self, adapter_name: str, *args, **kwargs) -> None:
        """Refused (``InputError``): adapters are added to the peft model before ``parallelize``."""
        raise InputError(f"add_adapter({adapter_name!r}): " + _fixed(self.active_adapters))

    def delete_adapter(self, adapter_name: str) -> None:
        """Refused (``InputError``): adapters are deleted on the peft model before ``parallelize``."""
        raise InputError(f"delete_adapter({adapter_name!r}): " + _fixed(self.active_adapters))

    # Switching them off.
    @property
    def adapters_disabled(self) -> bool:
        """Whether the adapters are switched off (``disable_adapter_layers``, inside ``disable_adapter``)."""
        return self.__dict__.get("_adapters_off") is not None

    def disable_adapter_layers(self) -> None:
        """Switch every active adapter off, as peft's ``disable_adapter_layers``: the module then computes the base
        model exactly, and the adapters get no gradient. Local on every rank; ``enable_adapter_layers`` switches
        them back on. Refused for DoRA, ``modules_to_save`` and under ``dp_mode='fsdp'``."""
        info = self._peft_info("disable_adapter_layers")
        if self.adapters_disabled:
            return
        fsdp = getattr(self.options, "dp_mode", None)
        if self.options.dp > 1 and getattr(fsdp, "value", fsdp) == "fsdp":
            raise InputError("disable_adapter under dp_mode='fsdp' is not supported (FSDP owns the parameters the "
                             "graph reads): use dp_mode='replicate', or compare against a parallel module of the "
                             "base model")
        held = self._holders()
        plan = off_plan(held, self.active_adapters)
        stand_ins = {}
        for key, value in plan.items():
            for tensor in held[key]:
                stand_ins.setdefault(id(tensor), (tensor, _stand_in(tensor, value)))
        # The graphs read stand-ins in place of the adapters' parameters: the parameters themselves are not touched,
        # so a forward made before (whose backward reads them), an optimizer step and the values put back are exact.
        swapped = _swap(self, {i: new for i, (_, new) in stand_ins.items()})
        hook = self.register_forward_pre_hook(lambda module, args: module._check_adapters_off())
        self.__dict__["_adapters_off"] = (swapped, hook, info)

    def enable_adapter_layers(self) -> None:
        """Switch the adapters back on (the graphs read their parameters again)."""
        self._peft_info("enable_adapter_layers")
        state = self.__dict__.pop("_adapters_off", None)
        if state is None:
            return
        swapped, hook, _ = state
        hook.remove()
        for owner, leaf, original in swapped:
            owner._parameters[leaf] = original

    def _adapters_on(self, what: str) -> None:
        """Refuse ``what`` (reading or writing the module's state) while the adapters are switched off."""
        if self.adapters_disabled:
            raise InputError(f"{what} while the adapters are switched off would see their stand-ins, not their "
                             "values: leave the `with pm.disable_adapter():` block (or call "
                             "pm.enable_adapter_layers()) first")

    @contextlib.contextmanager
    def disable_adapter(self):
        """``with pm.disable_adapter():`` as peft's: the base model's outputs inside (exactly), the adapters as
        they were after. TRL's DPO reference pass and a base-versus-adapter comparison use it."""
        was_off = self.adapters_disabled
        self.disable_adapter_layers()
        try:
            yield
        finally:
            if not was_off:
                self.enable_adapter_layers()

    def _check_adapters_off(self) -> None:
        """Refuse a forward the switched-off adapters would not compute as peft does (called before each forward
        while they are off)."""
        if not self.adapters_disabled:
            return
        dropout = {n: c.lora_dropout for n, c in self.peft.configs.items() if getattr(c, "lora_dropout", 0)}
        # the graph's dropouts are nn.Dropout modules: none left drawing when they were switched off (TRL's
        # disable_dropout_in_model sets their p to 0)
        drawing = any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in self.modules())
        if self.training and drawing and any(n in dropout for n in self.active_adapters):
            raise InputError(f"a forward in train mode with the adapters off and lora_dropout {dropout}: the "
                             "captured graph still draws the adapters' dropout masks, which peft skips while they "
                             "are off, so every later mask would differ from one process's. Call pm.eval() for "
                             "the pass with the adapters off (then pm.train()), or use lora_dropout=0")

    # Counting.
    def get_nb_trainable_parameters(self) -> tuple[int, int]:
        """(trainable parameters, all parameters) of the unsharded peft model, as peft's
        ``get_nb_trainable_parameters`` counts them (not this rank's shards), with the current ``requires_grad``."""
        info = self._peft_info("get_nb_trainable_parameters")
        self._adapters_on("get_nb_trainable_parameters")
        held = self._holders()
        trainable = total = 0
        for name, param in info.skeleton.named_parameters():
            tensors = held.get(name)  # another pipeline stage's: as captured
            trains = tensors[0].requires_grad if tensors else param.requires_grad
            total += param.numel()
            trainable += param.numel() if trains else 0
        return trainable, total

    def print_trainable_parameters(self) -> None:
        """Print peft's line (``trainable params: ... || all params: ... || trainable%: ...``) for the unsharded
        model, as ``get_nb_trainable_parameters`` counts."""
        trainable, total = self.get_nb_trainable_parameters()
        print(f"trainable params: {trainable:,d} || all params: {total:,d} || "
              f"trainable%: {100 * trainable / total:.4f}")

    # Gradient checkpointing and input gradients.
    @property
    def is_gradient_checkpointing(self) -> bool:
        """Whether backward recomputes activations (the ``recompute`` option given to ``parallelize``)."""
        return self.options.recompute is not Recompute.NONE

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs=None, **kwargs) -> None:
        """Accepted when the module was parallelized with ``recompute`` (it already recomputes); else
        ``InputError`` naming that option: the graph's recompute is chosen at ``parallelize``."""
        if not self.is_gradient_checkpointing:
            raise InputError("gradient checkpointing of a parallel module is chosen at parallelize: pass "
                             "recompute='blocks' to autotp.parallelize (the same memory saving, exact), and with "
                             "Trainer/TRL set gradient_checkpointing=False in the training arguments")

    activation_checkpointing_enable = gradient_checkpointing_enable

    def gradient_checkpointing_disable(self) -> None:
        """Accepted, changing nothing: recompute changes no value, only memory (TRL turns checkpointing off around
        its no-grad reference pass, where nothing is recomputed)."""

    def enable_input_require_grads(self) -> None:
        """Accepted, changing nothing: it makes the embedding's output require grad so that reentrant checkpointing
        of a frozen model has something to differentiate; the module's recompute does not need it, and no
        parameter's gradient changes."""

    def disable_input_require_grads(self) -> None:
        """Accepted, changing nothing (see ``enable_input_require_grads``)."""

    # What a parallel module cannot hand back.
    def merge_and_unload(self, *args, **kwargs):
        """Refused (``InputError``): a parallel module cannot become the unsharded base model. Says what to do."""
        raise InputError(_UNLOAD.format(what="merge_and_unload()"))

    def unload(self, *args, **kwargs):
        """Refused (``InputError``), as ``merge_and_unload``."""
        raise InputError(_UNLOAD.format(what="unload()"))

    def get_base_model(self):
        """Refused (``InputError``): the base model's modules are not held by a parallel module."""
        raise InputError(_UNLOAD.format(what="get_base_model()"))


_UNLOAD = ("{what} on a parallel module: it holds one rank's shards of one captured graph, not the base model's "
           "modules. To serve the merged weights from the parallel module call pm.merge_adapters() (folded into the "
           "shards, exactly as merge_and_unload computes them); to write a merged checkpoint, save the adapters with "
           "pm.save_pretrained(folder) and merge on one process: PeftModel.from_pretrained(base, folder)"
           ".merge_and_unload().save_pretrained(out); to compute the base model, use `with pm.disable_adapter():`")


def unsupported_peft(pm, name: str) -> None:
    """``ModelPartError`` (an AttributeError: ``hasattr`` stays False) for a ``PeftModel`` method or attribute that a
    parallel module of a peft model does not offer (``add_weighted_adapter``, ``get_layer_status``, ...), saying so
    rather than torch's bare "has no attribute"; nothing for any other name."""
    info = pm.__dict__.get("peft")
    if info is None or name.startswith("_"):
        return
    if name == "peft_config":
        # Not offered: peft's functions that take a model (get_peft_model_state_dict, set_peft_model_state_dict)
        # read its peft_config, then its tuner layers, which a parallel module has not: they would return nothing
        raise ModelPartError("autotp: a parallel module has no peft_config, so that peft's functions taking a model "
                             "(get_peft_model_state_dict, set_peft_model_state_dict), which would find none of its "
                             "adapter layers, fail rather than save or load nothing: use pm.save_pretrained(folder) "
                             "and pm.load_adapter(folder); the adapters' configs are pm.peft.configs")
    # PeftModel's own, and its tuner's (LoraModel's add_weighted_adapter), which PeftModel forwards to
    owners = (type(info.skeleton), type(getattr(info.skeleton, "base_model", None)))
    if not any(hasattr(owner, name) for owner in owners) or hasattr(torch.nn.Module, name):
        return
    raise ModelPartError(f"autotp: peft's PeftModel.{name} is not offered by a parallel module of a peft model (it "
                         "runs the graph captured at parallelize, with the adapters active then). What it offers of "
                         "peft's methods, and what to do instead of the others, is listed in docs/finetuning.md, "
                         "\"peft's methods on a parallel module\"; or call it on the peft model before "
                         "autotp.parallelize") from None


@contextlib.contextmanager
def reading(pm, stand_ins: dict[int, torch.nn.Parameter]):
    """Within the block, ``pm``'s graphs read ``stand_ins[id(t)]`` in place of each tensor ``t`` keyed there (its
    reference's frozen copies); the tensors themselves are not touched."""
    swapped = _swap(pm, stand_ins)
    try:
        yield
    finally:
        for owner, leaf, original in swapped:
            owner._parameters[leaf] = original


def _stand_in(tensor: torch.Tensor, value: float) -> torch.nn.Parameter:
    """A frozen parameter like ``tensor`` (its shape, dtype, device and layout) filled with ``value``."""
    return torch.nn.Parameter(torch.full_like(tensor.detach(), value), requires_grad=False)


def _swap(module: torch.nn.Module, stand_ins: dict[int, torch.nn.Parameter]) -> list:
    """Replace, in every submodule of ``module`` (both modes' graphs, every stage), each parameter whose id is a key
    of ``stand_ins`` by its stand-in; returns (owner, name, original) to put back."""
    swapped = []
    for owner in module.modules():
        for leaf, param in list(owner._parameters.items()):
            if param is not None and id(param) in stand_ins:
                owner._parameters[leaf] = stand_ins[id(param)]
                swapped.append((owner, leaf, param))
    return swapped


def _fixed(active: list[str]) -> str:
    return _FIXED_ADAPTERS.format(active=active, first=active[0] if active else "default")
