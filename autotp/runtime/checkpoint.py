"""Saving and loading a parallel module (and its optimizer): sharded DCP checkpoints and Hugging Face exports.

``pm.save(DIR)`` writes a DCP checkpoint in which each rank writes its own chunks (no gather, no full copy):
model tensors under ``model.<original name>`` and optimizer state under ``optimizer.state.<name>.<key>`` (moments
chunked like their parameter) and ``optimizer.param_groups.<name>`` (the hyperparameters), torch's flattened
optimizer names, and an LR scheduler's state dict under ``scheduler``. Every tensor is recorded with its full size and each chunk's global offsets, so a module of
any ``(tp, pp)`` layout loads it and reads only the chunks it needs. ``format="safetensors"`` gathers the
full tensors to the first rank and writes Hugging Face's layout (with ``config.json``), which
``from_pretrained`` loads.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from autotp.errors import InputError
from autotp.passes.placement import Part, PlacementKind, part_of
from autotp.planning.plan import Plan
from autotp.runtime import dcp
from autotp.runtime.data_parallel import dp_shard, gathered, local, placed_like
from autotp.runtime.manifest import agree
from autotp.runtime.matching import Expected, match
from autotp.runtime.readers import HF_INDEX, HF_SINGLE, MODEL_PREFIX, DcpReader, open_reader, read_into
from autotp.runtime.staging import write_atomically

OPTIMIZER_STATE = "optimizer.state."
OPTIMIZER_GROUPS = "optimizer.param_groups."
SCHEDULER = "scheduler"
"""The key of an LR scheduler's state dict (the same on every rank: one object, written once)."""
FORMATS = ("dcp", "safetensors")
MAX_SHARD_BYTES = 5 * 2**30
"""Largest safetensors file of an export (Hugging Face's default, 5 GB); bigger models are split into files
listed by ``model.safetensors.index.json``."""


@dataclass
class Holding:
    """What one rank holds of a parallel module, for checkpoints."""

    tensors: dict[str, tuple[torch.Tensor, Part]]
    """Original (kept) name -> this rank's tensor and the part of the full tensor it is."""
    params: dict[str, nn.Parameter]
    """Original name -> this rank's parameter (to name an optimizer's state)."""
    aliases: dict[str, str]
    """Every name of the original model -> the name its (possibly tied) tensor is kept under."""
    group: object
    """The process group a save is collective over (None: the default group)."""
    distributed: bool
    sharded: dict[str, torch.Tensor] = field(default_factory=dict)
    """Original name -> the module's own FSDP DTensor, where ``tensors`` holds a copy whole over dp (a load
    fills the copy, then the DTensor's local shard from it)."""


def holding(plan: Plan, tp_rank: int, own: dict[str, torch.Tensor], params: dict[str, nn.Parameter],
            extra: dict[str, object], aliases: dict[str, str], group, distributed: bool,
            shapes: dict[str, tuple[int, ...]], experts: tuple[int, int] | None = None) -> Holding:
    """The ``Holding`` of a rank whose tensors are ``own`` (tp shards under original names; FSDP DTensors are
    gathered over dp, a collective), plus ``extra`` state every rank keeps whole (tensors only are saved).
    With data parallelism every replica holds the same chunks: a save over the whole world writes each once.
    ``shapes``: the full tensors' shapes by name (a shard does not tell them where its chunks differ).
    ``experts``: (this rank's place in its expert-parallel group, ep) when ep is above tp: a bank split by expert
    is then recorded by the experts the rank holds, not by its tp rank, so any layout reads the right rows."""
    tensors, sharded = {}, {name: t for name, t in own.items() if isinstance(t, DTensor)}
    for name, tensor in own.items():
        tensor = gathered(tensor)
        placement = plan.placements.get(name)
        shape = shapes[name] if placement is not None and placement.is_split else tuple(tensor.shape)
        rank, count = _part_rank(placement, tp_rank, plan.tp, experts)
        tensors[name] = (tensor, part_of(placement, shape, rank, count))
    for name, value in extra.items():
        if isinstance(value, torch.Tensor):
            tensors.setdefault(name, (value, Part(tuple(value.shape))))
    return Holding(tensors, params, aliases, group, distributed, sharded)


def _part_rank(placement, tp_rank: int, tp: int, experts: tuple[int, int] | None) -> tuple[int, int]:
    """The (rank, ranks) a tensor placed as ``placement`` is cut by: an expert-split bank by its expert-parallel
    rank among ``ep`` when ``experts`` is given (ep above tp), anything else by its tp rank among ``tp``."""
    if experts is not None and placement is not None and placement.kind is PlacementKind.EXPERT:
        return experts
    return tp_rank, tp


def _format(value: str) -> str:
    if value not in FORMATS:
        raise InputError(f"format must be one of {list(FORMATS)}, got {value!r}")
    return value


def save(held: Holding, path: str | os.PathLike, optimizer: torch.optim.Optimizer | None = None,
         scheduler=None) -> None:
    """Write ``held`` (and ``optimizer``'s and an LR ``scheduler``'s state) as a sharded DCP checkpoint at ``path``;
    collective."""
    state: dict[str, object] = {MODEL_PREFIX + n: dcp.Sharded.of(t.detach(), p) for n, (t, p) in held.tensors.items()}
    if optimizer is not None:
        state |= optimizer_state(optimizer, held)
    if scheduler is not None:
        state[SCHEDULER] = scheduler.state_dict()
    write_atomically(path, lambda folder: dcp.save(state, folder, held.group, held.distributed), held.group,
                     held.distributed, _first(held))


def _first(held: Holding) -> bool:
    return not held.distributed or dist.get_rank(held.group) == 0


def _param_names(optimizer: torch.optim.Optimizer, held: Holding) -> list[str]:
    """The original name of each of ``optimizer``'s parameters, in its order (its state dict's indices)."""
    names = {id(p): n for n, p in held.params.items()}
    params = [p for group in optimizer.param_groups for p in group["params"]]
    strangers = sum(id(p) not in names for p in params)
    if strangers:
        raise InputError(f"the optimizer holds {strangers} parameter(s) that are not this parallel module's; make it "
                         "from pm.parameters() (this rank's shards)")
    return [names[id(p)] for p in params]


def optimizer_state(optimizer: torch.optim.Optimizer, held: Holding) -> dict[str, object]:
    """``optimizer``'s state keyed by parameter names: tensors shaped like their parameter chunked like it."""
    names = _param_names(optimizer, held)
    saved = optimizer.state_dict()
    out: dict[str, object] = {}
    for index, values in saved["state"].items():
        name = names[index]
        mine, part = held.tensors[name]  # the parameter whole over dp, this rank's over tp
        for key, value in values.items():
            if isinstance(value, torch.Tensor):
                value = gathered(value)  # a DTensor moment: whole over dp, this rank's over tp, like ``mine``
                chunked = part if tuple(value.shape) == tuple(mine.shape) else Part(tuple(value.shape))
                out[f"{OPTIMIZER_STATE}{name}.{key}"] = dcp.Sharded.of(value, chunked)
            else:
                out[f"{OPTIMIZER_STATE}{name}.{key}"] = value
    at = 0
    for group in saved["param_groups"]:
        hyper = {k: v for k, v in group.items() if k != "params"}
        for _ in group["params"]:
            out[OPTIMIZER_GROUPS + names[at]] = hyper
            at += 1
    return out


def load(held: Holding, path: str | os.PathLike, optimizer: torch.optim.Optimizer | None, show: bool,
         strict: bool = True, verify: bool = True, persistent: set[str] | None = None, scheduler=None) -> None:
    """Fill ``held``'s tensors (and ``optimizer``'s state) from the checkpoint at ``path``; collective over
    ``held.group`` (files verified on their manifest when ``verify``, and a failure on any rank fails every rank).

    Every tensor found must have the full shape and kind of dtype of the module's; parameters, and the buffers
    among ``persistent`` (the original state dict's keys), must be there unless not ``strict``."""
    reader = open_reader(path, held.group, held.distributed, verify)
    agree(lambda: _fill(held, reader, optimizer, show, strict, persistent, scheduler), held.group, held.distributed,
          f"loading the checkpoint {str(path)!r}")


def _fill(held: Holding, reader, optimizer, show: bool, strict: bool, persistent: set[str] | None,
          scheduler=None) -> None:
    """``load``'s reading, on one rank: checked against the module first, then read in place."""
    path = reader.path
    names_of = {}
    for alias, kept in held.aliases.items():
        names_of.setdefault(kept, []).append(alias)
    expected = [Expected(name, tuple(names_of.get(name, [name])), part.shape, tensor.dtype,
                         required=name in held.params or persistent is None
                         or any(n in persistent for n in names_of.get(name, [name])))
                for name, (tensor, part) in held.tensors.items()]
    found = match(expected, reader.shapes, reader.dtypes, f"checkpoint {str(path)!r}", strict)
    items = [(found[name], part, tensor.detach()) for name, (tensor, part) in held.tensors.items() if name in found]
    read_into(reader, items, f"loading {Path(path).name}", show)  # in place: no second copy of the shards
    with torch.no_grad():
        for name, own in held.sharded.items():
            local(own).copy_(dp_shard(held.tensors[name][0], own))
    if optimizer is not None:
        if not isinstance(reader, DcpReader):
            raise InputError(f"checkpoint {str(path)!r} holds no optimizer state (only pm.save's DCP checkpoints do); "
                             "leave optimizer= out to load the model alone")
        load_optimizer(optimizer, held, path)
    if scheduler is not None:
        if not isinstance(reader, DcpReader):
            raise InputError(f"checkpoint {str(path)!r} holds no scheduler state (only pm.save's DCP checkpoints do); "
                             "leave scheduler= out to load the model alone")
        load_scheduler(scheduler, path)


def load_scheduler(scheduler, path: str | os.PathLike) -> None:
    """Load an LR scheduler's state from a DCP checkpoint ``pm.save(..., scheduler=)`` wrote."""
    if SCHEDULER not in dcp.read_metadata(path).state_dict_metadata:
        raise InputError(f"checkpoint {str(path)!r} has no scheduler state; save with pm.save(path, optimizer=opt, "
                         "scheduler=sched), or leave scheduler= out")
    state: dict[str, object] = {SCHEDULER: None}
    dcp.load(state, path)
    scheduler.load_state_dict(state[SCHEDULER])


def load_optimizer(optimizer: torch.optim.Optimizer, held: Holding, path: str | os.PathLike) -> None:
    """Load the state of ``optimizer`` (made from this module's parameters) from a DCP checkpoint; the layout
    it was saved at may differ (moments are read chunk by chunk like their parameters)."""
    names = _param_names(optimizer, held)
    meta = dcp.read_metadata(path).state_dict_metadata
    state: dict[str, object] = {}
    tensors: dict[str, torch.Tensor] = {}  # the local tensors the Sharded values' chunks are views of
    for name in names:
        if OPTIMIZER_GROUPS + name not in meta:
            raise InputError(f"checkpoint {str(path)!r} has no optimizer state for {name}; save with "
                             "pm.save(path, optimizer=opt), or leave optimizer= out")
        state[OPTIMIZER_GROUPS + name] = None
        part = held.tensors[name][1]
        for key in _state_keys(meta, name):
            md = meta[key]
            if isinstance(md, dcp.TensorStorageMetadata):
                chunked = part if tuple(md.size) == part.shape else Part(tuple(md.size))
                tensors[key] = torch.empty(chunked.local_shape, dtype=md.properties.dtype)
                state[key] = dcp.Sharded.of(tensors[key], chunked)
            else:
                state[key] = None
    dcp.load(state, path)
    values = state | tensors
    per_param = {i: {key[len(OPTIMIZER_STATE) + len(name) + 1:]: _like_param(values[key], held.params[name])
                     for key in _state_keys(values, name)} for i, name in enumerate(names)}
    groups, at = [], 0
    for group in optimizer.param_groups:
        count = len(group["params"])
        groups.append(dict(values[OPTIMIZER_GROUPS + names[at]]) | {"params": list(range(at, at + count))})
        at += count
    optimizer.load_state_dict({"state": {i: v for i, v in per_param.items() if v}, "param_groups": groups})


def _like_param(value, param: torch.Tensor):
    """An optimizer state value as its parameter holds it: shaped like a DTensor parameter (tp, FSDP or both), a
    DTensor of its layout (the moments of a DTensor parameter are DTensors like it)."""
    if isinstance(param, DTensor) and isinstance(value, torch.Tensor) and value.dim() == param.dim() > 0:
        return placed_like(value, param)
    return value


def _state_keys(keys, name: str) -> list[str]:
    """The keys of parameter ``name``'s optimizer state among ``keys`` (state keys hold no dot: a longer name
    that starts with ``name.`` is another parameter's)."""
    prefix = f"{OPTIMIZER_STATE}{name}."
    return [k for k in keys if k.startswith(prefix) and "." not in k[len(prefix):]]


def export_safetensors(full: dict[str, object], aliases: dict[str, str], path: str | os.PathLike, configs,
                       write: bool, max_shard_bytes: int = MAX_SHARD_BYTES) -> None:
    """Write the full tensors ``full`` (original keys) in Hugging Face's layout: each tied tensor once, under its
    first name (as ``save_pretrained`` does), files of at most ``max_shard_bytes`` with their index, and each of
    ``configs`` that can save itself (``config.json``, ``generation_config.json``). Only the rank with ``write``
    writes."""
    if not write:
        return
    from safetensors.torch import save_file

    tensors = {k: v.detach().contiguous() for k, v in full.items()
               if isinstance(v, torch.Tensor) and aliases.get(k, k) == k}
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    files = _split_files(tensors, max_shard_bytes)
    file_names = [HF_SINGLE] if len(files) == 1 else [f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
                                                      for i in range(len(files))]
    for file_name, names in zip(file_names, files):
        save_file({n: tensors[n] for n in names}, str(folder / file_name), metadata={"format": "pt"})
        _readable(folder / file_name)
    if len(files) > 1:
        weight_map = {n: file_name for file_name, names in zip(file_names, files) for n in names}
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (folder / HF_INDEX).write_text(json.dumps(index, indent=2), encoding="utf-8")
    for config in configs:
        if config is not None and hasattr(config, "save_pretrained"):
            config.save_pretrained(str(folder))


def _readable(path: Path) -> None:
    """Give ``path`` the mode a new file gets under the process's umask: safetensors writes 0600 (through a
    private temporary file), which hides an export from the group that a config.json beside it is shared with."""
    mask = os.umask(0)
    os.umask(mask)
    path.chmod(0o666 & ~mask)


def _split_files(tensors: dict[str, torch.Tensor], max_bytes: int) -> list[list[str]]:
    """Names grouped into files of at most ``max_bytes`` (a bigger tensor gets a file of its own), in order."""
    files: list[list[str]] = [[]]
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if files[-1] and size + nbytes > max_bytes:
            files.append([])
            size = 0
        files[-1].append(name)
        size += nbytes
    return files


class Checkpointing:
    """``save`` and ``load`` for the parallel modules, which provide ``_holding()`` and ``full_state_dict()``."""

    model_config = None
    """The original model's ``config`` (a Hugging Face model's), written beside a safetensors export."""

    def _holding(self) -> Holding:
        raise NotImplementedError

    def _export_configs(self) -> list:
        """The configs a safetensors export writes beside the tensors."""
        return [self.model_config]

    def save(self, path: str | os.PathLike, optimizer: torch.optim.Optimizer | None = None, format: str = "dcp",
             max_shard_bytes: int = MAX_SHARD_BYTES, *, scheduler=None) -> None:
        """Save the model (and ``optimizer``'s and an LR ``scheduler``'s state) at ``path``; a collective call, made
        by every rank.

        ``format="dcp"``: a torch.distributed.checkpoint directory in which each rank writes its own shards (no
        gather, no full copy), keyed by the original names with full sizes: ``parallelize(model, checkpoint=path)``
        or ``pm.load(path)`` at any ``(tp, pp)`` reads it back. ``format="safetensors"``: full tensors gathered
        and written by the first rank in Hugging Face's layout (``model.safetensors``, or files of at most
        ``max_shard_bytes`` with ``model.safetensors.index.json``, the model's ``config.json`` and
        ``generation_config.json``), which
        ``from_pretrained(path)`` loads; model only.

        Either is written beside ``path`` and renamed into place once every rank has finished, with a manifest of
        each file's size and checksum: a checkpoint already at ``path`` survives a crash during the save.
        """
        held = self._holding()
        if _format(format) == "dcp":
            save(held, path, optimizer, scheduler)
            return
        if optimizer is not None or scheduler is not None:
            raise InputError("format='safetensors' exports the model only; save optimizer and scheduler state with "
                             "format='dcp'")
        full = self.full_state_dict()  # collective: every rank gathers
        configs = self._export_configs()
        first = _first(held)
        write_atomically(path, lambda folder: export_safetensors(full, held.aliases, folder, configs, first,
                                                                 max_shard_bytes), held.group, held.distributed, first)

    def load(self, path: str | os.PathLike, optimizer: torch.optim.Optimizer | None = None,
             quiet: bool = False, strict: bool = True, verify: bool = True, *, scheduler=None) -> None:
        """Load the model's tensors (and ``optimizer``'s and an LR ``scheduler``'s state, from a DCP checkpoint
        ``save`` wrote with them) from ``path``: a directory
        ``save`` wrote at any layout, a ``.safetensors`` file or a Hugging Face directory. Each rank reads only
        its own slices; the first rank draws a progress bar unless ``quiet``. A collective call, made by every rank.

        Every tensor must have the model's shape and kind of dtype, and every parameter and saved buffer must be
        in the checkpoint unless ``strict=False`` (they then keep their values); one ``CheckpointError`` lists
        every mismatch. With ``verify`` the files are first checked against the manifest ``save`` wrote (sizes
        and checksums, the work shared by the ranks); a failure on any rank fails every rank."""
        held = self._holding()
        names = getattr(self, "_names", None)  # the original state dict's keys: which buffers a checkpoint holds
        persistent = set(names.state_keys) if names is not None else None
        load(held, path, optimizer, _first(held) and not quiet, strict, verify, persistent, scheduler)
