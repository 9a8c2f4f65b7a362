"""PEFT adapters of a parallel module: saved as peft saves them, loaded back at any tp, merged into the base weights.

The planner places every LoRA adapter by its base layer (``planning.adapters``): on a column-split base ``A`` whole
and ``B`` split by its outputs, on a row-split base ``A`` split by its inputs and ``B`` whole. Merging
(``W + s * B @ A``, peft's ``merge_and_unload``) is then local on every rank: ``W_j + s * B_j @ A`` on a column split,
``W + s * B @ A_j`` on a row split, with no communication.

What is peft's here is only its file format and the per-layer ``scaling`` read off the model at ``parallelize``
(``PeftInfo.of``); the split itself was found from the graph.
"""

from __future__ import annotations

import copy
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from autotp.errors import CheckpointError, InputError
from autotp.runtime.tp_params import plain

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
_ADAPTER_PARTS = ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B", "lora_magnitude_vector")


@dataclass(frozen=True)
class PeftInfo:
    """What a parallel module keeps of a ``peft`` model: its configs, each LoRA layer's scaling, and its skeleton."""

    configs: dict = field(default_factory=dict)
    """Adapter name -> its peft config (a copy)."""
    scalings: dict = field(default_factory=dict)
    """Module name (as the model names it) -> {adapter name: the ``scaling`` its LoRA output is multiplied by}."""
    skeleton: object = None
    """The peft model with every parameter and buffer on the meta device (its modules, configs and wrappers, no
    data): peft's own ``get_peft_model_state_dict`` reads it to choose what to save, as ``save_pretrained`` does."""

    @classmethod
    def of(cls, model) -> PeftInfo | None:
        """The peft configs and scalings of ``model`` (a ``peft.PeftModel``), or None for any other model."""
        configs = getattr(model, "peft_config", None)
        if not isinstance(configs, dict) or not configs:
            return None
        scalings = {name: dict(m.scaling) for name, m in model.named_modules()
                    if isinstance(getattr(m, "scaling", None), dict) and hasattr(m, "lora_A")}
        return cls(copy.deepcopy(configs), scalings, _skeleton(model))


def _skeleton(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``model`` whose parameters and buffers are on the meta device (the user's model untouched, no
    memory held for its data)."""
    memo: dict[int, object] = {}
    for tensor in (*model.parameters(), *model.buffers()):
        meta = tensor.detach().to("meta")
        memo[id(tensor)] = torch.nn.Parameter(meta, tensor.requires_grad) if isinstance(tensor, torch.nn.Parameter) \
            else meta
    return copy.deepcopy(model, memo)


def _peft_key(key: str, adapter: str) -> str | None:
    """A state-dict key as peft saves it (the adapter's name taken out), or None for a key not of ``adapter``."""
    for part in _ADAPTER_PARTS:
        marker = f".{part}.{adapter}"
        if marker in key:
            return key.replace(marker, f".{part}")
    return None


def adapter_state(full: dict, adapter: str, info: PeftInfo | None = None) -> dict[str, torch.Tensor]:
    """The adapter's tensors of a full state dict, under the keys peft writes: chosen by peft's own
    ``get_peft_model_state_dict`` on ``info``'s skeleton (LoRA weights, ``modules_to_save`` copies, embedding layers
    as peft saves them); without a skeleton, the LoRA weights alone."""
    if info is not None and info.skeleton is not None:
        from peft import get_peft_model_state_dict

        chosen = get_peft_model_state_dict(info.skeleton, state_dict=full, adapter_name=adapter)
        return {key: value.detach().contiguous() for key, value in chosen.items()}
    out = {}
    for key, value in full.items():
        saved = _peft_key(key, adapter)
        if saved is not None:
            out[saved] = value.detach().contiguous()
    return out


def save_adapters(pm, directory: str | os.PathLike, info: PeftInfo) -> None:
    """Write each adapter as ``PeftModel.save_pretrained`` does (``adapter_config.json`` and
    ``adapter_model.safetensors``; adapters other than ``default`` in a folder of their name): full tensors gathered
    from every rank, written by the first. A collective call."""
    from safetensors.torch import save_file

    full = pm.full_state_dict()
    distributed = dist.is_available() and dist.is_initialized()
    if not distributed or dist.get_rank() == 0:  # every stage's and replica's ranks hold it all: one writes
        for name, config in info.configs.items():
            folder = Path(directory) if name == "default" else Path(directory) / name
            folder.mkdir(parents=True, exist_ok=True)
            config.save_pretrained(str(folder))
            # tensors sharing memory (tied weights) are written apart, as peft's save_pretrained clones them
            state = {k: v.clone() for k, v in adapter_state(full, name, info).items()}
            save_file(state, str(folder / WEIGHTS_NAME), metadata={"format": "pt"})
    if distributed:
        dist.barrier()  # the files are complete on return, on every rank


def _ours(key: str, adapter: str, known: set[str]) -> str | None:
    """The parallel module's key for ``key`` of a file peft saved: an adapter weight with the adapter's name put
    back, a ``modules_to_save`` copy's (``lm_head.weight`` -> ``lm_head.modules_to_save.default.weight``), or a
    base weight peft saves as it is (a targeted embedding's)."""
    pattern = r"\.(" + "|".join(_ADAPTER_PARTS) + r")(\.|$)"
    candidates = [re.sub(pattern, lambda m: f".{m.group(1)}.{adapter}{m.group(2)}", key, count=1)]
    module, _, leaf = key.rpartition(".")
    candidates += [f"{module}.modules_to_save.{adapter}.{leaf}", key]
    return next((c for c in candidates if c in known), None)


def load_adapter(pm, directory: str | os.PathLike, adapter: str = "default") -> None:
    """Load an adapter saved by peft (or by ``save_adapters``, at any tp) into ``pm``'s adapter ``adapter``: each
    rank takes its slices."""
    from safetensors.torch import load_file

    path = Path(directory) / WEIGHTS_NAME
    if not path.is_file():
        raise CheckpointError(f"{path} does not exist: pass the folder PeftModel.save_pretrained wrote")
    saved = load_file(str(path))
    known = set(pm.state_dict())
    mapped = {}
    for key, value in saved.items():
        ours = _ours(key, adapter, known)
        if ours is None:
            raise CheckpointError(f"{path} holds {key}, which this model has no place for; load an adapter saved "
                                  f"for this model and adapter name {adapter!r}")
        mapped[ours] = value
    pm.load_state_dict(mapped, strict=False)


def merge_adapters(pm, info: PeftInfo, adapter: str = "default") -> None:
    """Fold adapter ``adapter`` into the base weights (peft's ``merge_and_unload`` arithmetic, ``W += s * B @ A``) on
    every rank, locally, and zero its ``B`` so that the module computes the merged model: LoRA on linear layers and
    on vocabulary-split embeddings (``A`` split like the table's rows), not DoRA."""
    held = dict(pm.state_dict(keep_vars=True))

    with torch.no_grad():
        for module, scales in info.scalings.items():
            if adapter not in scales:
                continue
            names = {part: f"{module}.{part}.{adapter}.weight" for part in ("lora_A", "lora_B")}
            base = f"{module}.base_layer.weight"
            if f"{module}.lora_magnitude_vector.{adapter}.weight" in held:
                raise InputError(f"merge_adapters: {module} is a DoRA layer; merge it with peft on the unsharded model")
            table = (f"{module}.lora_embedding_A.{adapter}", f"{module}.lora_embedding_B.{adapter}")
            if base in held and all(n in held for n in table):  # an embedding's: rows [vocab_j] += s * A_j.T @ B.T
                a, b, w = (plain(held[n]) for n in (*table, base))
                w.add_((a.t() @ b.t()).to(w.dtype), alpha=scales[adapter])
                b.zero_()
                continue
            if base not in held or any(n not in held for n in names.values()):
                continue  # another pipeline stage's layer
            a, b, w = (plain(held[n]) for n in (names["lora_A"], names["lora_B"], base))
            w.add_((b @ a).to(w.dtype), alpha=scales[adapter])
            b.zero_()
