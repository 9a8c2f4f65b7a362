"""Checkpoints as tensor sources: each rank reads only its own slices of a file, never the whole model.

Three kinds of checkpoint are read: a ``.safetensors`` file, a Hugging Face model directory (``model.safetensors``
or sharded files with ``model.safetensors.index.json``) and a torch.distributed.checkpoint (DCP) directory (what
``pm.save`` writes). Safetensors files are read with ``get_slice``, one tensor at a time with the file opened for
it alone (the file is memory-mapped: pages stay in the process's resident memory while it is open); DCP reads
the saved chunks that overlap the rank's. The model may be on the meta device (no values): everything it lacks
must be in the checkpoint, which is checked before anything is read.
"""

from __future__ import annotations

import json
import os
from enum import Enum
from pathlib import Path

import torch
from torch import nn

from autotp.capture.export import tensor_aliases
from autotp.errors import InputError
from autotp.rewrite.shards import Part
from autotp.rewrite.tensor_parallel import Source, Want
from autotp.runtime import dcp
from autotp.runtime.meta_init import empty_weights  # noqa: F401 (its home before; autotp re-exports it)
from autotp.runtime.progress import Progress

MODEL_PREFIX = "model."
"""DCP keys of model tensors start with this (optimizer state with ``optimizer.``), as torch's apps name them."""
HF_INDEX = "model.safetensors.index.json"
HF_SINGLE = "model.safetensors"


class Kind(str, Enum):
    """What a checkpoint path holds."""

    SAFETENSORS = "safetensors"
    HF_DIR = "Hugging Face directory"
    DCP = "torch.distributed.checkpoint"


def kind_of(path: str | os.PathLike) -> Kind:
    """The kind of checkpoint at ``path``, or an ``InputError`` saying what was expected."""
    p = Path(path)
    if p.is_file() and p.suffix == ".safetensors":
        return Kind.SAFETENSORS
    if p.is_dir() and (p / ".metadata").is_file():
        return Kind.DCP
    if p.is_dir() and ((p / HF_INDEX).is_file() or (p / HF_SINGLE).is_file()):
        return Kind.HF_DIR
    if not p.exists():
        what = "does not exist"
    elif p.is_file():
        what = "is a file without the .safetensors suffix"
    else:
        what = f"is a directory with neither {HF_INDEX}, {HF_SINGLE} nor .metadata"
    raise InputError(f"checkpoint={str(path)!r} {what}; pass a .safetensors file, a Hugging Face model directory "
                     "(save_pretrained's) or a directory pm.save wrote")


def _safe_open(path: Path):
    try:
        from safetensors import safe_open
    except ImportError as e:  # a dependency of autotp; only a broken install lacks it
        raise InputError("reading .safetensors checkpoints needs the safetensors package: "
                         "pip install safetensors") from e
    return safe_open(str(path), framework="pt", device="cpu")


class SafetensorsReader:
    """Tensors by name from a ``.safetensors`` file or a Hugging Face directory's files."""

    def __init__(self, path: str | os.PathLike, kind: Kind):
        self.path = Path(path)
        self.files: dict[str, Path] = {}
        if kind is Kind.SAFETENSORS:
            files = [self.path]
        elif (self.path / HF_INDEX).is_file():
            weight_map = json.loads((self.path / HF_INDEX).read_text(encoding="utf-8"))["weight_map"]
            self.files = {name: self.path / file for name, file in weight_map.items()}
            files = sorted(set(self.files.values()))
        else:
            files = [self.path / HF_SINGLE]
        self.shapes: dict[str, tuple[int, ...]] = {}
        for file in files:
            with _safe_open(file) as f:
                for name in f.keys():
                    self.files[name] = file
                    self.shapes[name] = tuple(f.get_slice(name).get_shape())

    def read(self, items: list[tuple[str, Part, torch.dtype]], progress: Progress) -> list[torch.Tensor]:
        """Each named tensor's ``part``, as ``dtype``."""
        out = [torch.empty(part.local_shape, dtype=dtype) for _, part, dtype in items]
        self.read_into([(name, part, dest) for (name, part, _), dest in zip(items, out)], progress)
        return out

    def read_into(self, items: list[tuple[str, Part, torch.Tensor]], progress: Progress) -> None:
        """Copy each named tensor's ``part`` into the tensor given with it (cast to its dtype), a run at a time:
        only those slices are read out of the file.

        Always a copy: safetensors hands out tensors backed by a copy-on-write map of the file, whose untouched
        pages would change (or fault) if the file were rewritten while training, say by an export to the same
        path.
        """
        for name, part, dest in items:
            with _safe_open(self.files[name]) as f:  # opened per tensor, so its mapped pages are let go after it
                if part.whole:
                    dest.copy_(f.get_tensor(name))
                else:
                    view, lead = f.get_slice(name), (slice(None),) * part.dim
                    for (start, length), target in zip(part.runs, part.views(dest)):
                        target.copy_(view[(*lead, slice(start, start + length))])
            progress.advance(dest.numel() * dest.element_size())


class DcpReader:
    """Model tensors by name from a DCP directory (keys ``model.<name>``)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        tensors = dcp.tensor_metadata(dcp.read_metadata(path))
        self.meta = {k[len(MODEL_PREFIX):]: md for k, md in tensors.items() if k.startswith(MODEL_PREFIX)}
        self.shapes = {name: tuple(md.size) for name, md in self.meta.items()}

    def read(self, items: list[tuple[str, Part, torch.dtype]], progress: Progress) -> list[torch.Tensor]:
        """Each named tensor's ``part``, as ``dtype``."""
        out = [torch.empty(part.local_shape, dtype=dtype) for _, part, dtype in items]
        self.read_into([(name, part, dest) for (name, part, _), dest in zip(items, out)], progress)
        return out

    def read_into(self, items: list[tuple[str, Part, torch.Tensor]], progress: Progress) -> None:
        """Copy each named tensor's ``part`` into the tensor given with it (cast to its dtype), in one pass over
        the files: DCP reads the saved chunks that overlap the part's, straight into place."""
        state = {MODEL_PREFIX + name: dcp.Sharded.of(dest, part) for name, part, dest in items}
        dcp.load(state, self.path, on_read=lambda nbytes: progress.advance(nbytes, tensors=0))
        progress.advance(0, tensors=len(items))


def open_reader(path: str | os.PathLike) -> SafetensorsReader | DcpReader:
    """A reader for the checkpoint at ``path``, whatever its kind."""
    kind = kind_of(path)
    return DcpReader(path) if kind is Kind.DCP else SafetensorsReader(path, kind)


def _groups(model: nn.Module) -> dict[str, list[str]]:
    """Every tensor's first name -> all its names (a tied weight has several; a checkpoint may hold any one)."""
    groups: dict[str, list[str]] = {}
    for name, first in tensor_aliases(model).items():
        groups.setdefault(first, []).append(name)
    return groups


def check_covers(model: nn.Module, shapes: dict[str, tuple[int, ...]], where: str) -> dict[str, str]:
    """Each of the model's tensors (by first name) -> the name the checkpoint holds it under.

    Every tensor on the meta device must be in the checkpoint, and every tensor found must have the model's
    shape; either failure is an ``InputError`` naming the tensors and what to change.
    """
    groups = _groups(model)
    tensors = dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers(remove_duplicate=False))
    found, missing, wrong = {}, [], []
    for first, names in groups.items():
        name = next((n for n in names if n in shapes), None)
        tensor = tensors[first]
        if name is None:
            if tensor.is_meta:
                missing.append(first)
            continue
        if tuple(shapes[name]) != tuple(tensor.shape):
            wrong.append(f"{name} {list(shapes[name])} (the model's: {list(tensor.shape)})")
        found[first] = name
    if wrong:
        raise InputError(f"{len(wrong)} tensor(s) in {where} have another shape than the model's: "
                         f"{', '.join(wrong[:5])}; build the model from the checkpoint's config")
    if missing:
        buffers = {n for n, _ in model.named_buffers(remove_duplicate=False)}
        kinds = [("buffer(s)", [n for n in missing if n in buffers]),
                 ("parameter(s)", [n for n in missing if n not in buffers])]
        listing = "; ".join(f"{len(names)} {kind}: {', '.join(names[:6])}{' ...' if len(names) > 6 else ''}"
                            for kind, names in kinds if names)
        raise InputError(
            f"the model has tensors on the meta device (no values) that {where} does not hold: {listing}. "
            "Buffers computed at construction (rotary inv_freq, masks) are not saved in checkpoints: build the model "
            "under autotp.empty_weights() or accelerate's init_empty_weights() (both keep buffers real), or give "
            "these tensors values before parallelize; parameters must be in the checkpoint (check its names)")
    return found


def checkpoint_source(path: str | os.PathLike, model: nn.Module, show: bool) -> Source:
    """A tensor source reading each rank's slices from the checkpoint at ``path`` (checked against ``model``
    first); tensors the checkpoint lacks come from the model itself. ``show`` draws a progress bar."""
    reader = open_reader(path)
    found = check_covers(model, reader.shapes, f"checkpoint {str(path)!r}")
    return lambda wants: read_wants(reader, found, wants, f"loading {Path(path).name}", show)


def read_wants(reader, found: dict[str, str], wants: list[Want], label: str, show: bool) -> list[torch.Tensor]:
    """Every want's tensor: from the checkpoint (cast to the model's dtype) where it is held, else the model's own."""
    held = [i for i, w in enumerate(wants) if w.name in found]
    items = [(found[wants[i].name], wants[i].part, wants[i].tensor.dtype) for i in held]
    nbytes = sum(_nbytes(part.local_shape, dtype) for _, part, dtype in items)
    progress = Progress(label, len(items), nbytes, show and bool(items))
    values = dict(zip(held, reader.read(items, progress)))
    progress.close()
    out = []
    for i, want in enumerate(wants):
        if i in values:
            out.append(values[i])
        elif want.tensor.is_meta:
            raise InputError(f"{want.name} is on the meta device and not in the checkpoint; give it values or add it "
                             "to the checkpoint")
        else:
            out.append(want.part.take(want.tensor.detach()))
    return out


def read_into(reader, items: list[tuple[str, Part, torch.Tensor]], label: str, show: bool) -> None:
    """``reader.read_into(items)`` with a progress bar (when ``show`` and there is something to read)."""
    nbytes = sum(_nbytes(dest.shape, dest.dtype) for _, _, dest in items)
    progress = Progress(label, len(items), nbytes, show and bool(items))
    reader.read_into(items, progress)
    progress.close()


def _nbytes(shape, dtype: torch.dtype) -> int:
    count = 1
    for size in shape:
        count *= size
    return count * dtype.itemsize
