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

from autotp.capture.core.export import tensor_aliases
from autotp.errors import CheckpointError, InputError
from autotp.passes.placement import Part, Source, Want
from autotp.runtime import dcp, staging
from autotp.runtime.manifest import agree
from autotp.runtime.matching import Expected, match
from autotp.runtime.progress import Progress
from autotp.runtime.safe_pickle import inside

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
            self.files = _index_files(self.path)
            files = sorted(set(self.files.values()))
        else:
            files = [self.path / HF_SINGLE]
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.dtypes: dict[str, str] = {}
        for file in files:
            try:
                with _safe_open(file) as f:
                    for name in f.keys():
                        view = f.get_slice(name)
                        self.files[name] = file
                        self.shapes[name], self.dtypes[name] = tuple(view.get_shape()), view.get_dtype()
            except (OSError, ValueError, RuntimeError) as e:  # safetensors' own errors are these kinds too
                raise CheckpointError(f"{file} is not a readable .safetensors file ({type(e).__name__}: {e}); it is "
                                      "damaged or incomplete") from e

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


def _index_files(folder: Path) -> dict[str, Path]:
    """Tensor name -> file, from a sharded Hugging Face directory's index; every file inside ``folder``."""
    where = folder / HF_INDEX
    try:
        weight_map = json.loads(where.read_text(encoding="utf-8")).get("weight_map")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError) as e:
        raise CheckpointError(f"{where} is not a readable index ({e}); it is damaged") from e
    if not isinstance(weight_map, dict):
        raise CheckpointError(f"{where} has no weight_map object (tensor name -> file); it is damaged")
    return {name: inside(folder, file, f"{where} (for {name})") for name, file in weight_map.items()}


class DcpReader:
    """Model tensors by name from a DCP directory (keys ``model.<name>``)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        tensors = dcp.tensor_metadata(dcp.read_metadata(path))
        self.meta = {k[len(MODEL_PREFIX):]: md for k, md in tensors.items() if k.startswith(MODEL_PREFIX)}
        self.shapes = {name: tuple(md.size) for name, md in self.meta.items()}
        self.dtypes = {name: md.properties.dtype for name, md in self.meta.items()}

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


def open_reader(path: str | os.PathLike, group=None, distributed: bool = False,
                verify: bool = True) -> SafetensorsReader | DcpReader:
    """A reader for the checkpoint at ``path``, whatever its kind; with ``verify``, its files are first checked
    against the manifest a save wrote. A collective over ``group`` when ``distributed`` (call it on every rank):
    a failure on any rank fails every rank. A save that did not finish is named as such, and nothing is
    unpickled before the files are checked."""
    where = f"opening the checkpoint {str(path)!r}"
    path, kind = agree(lambda: _located(path), group, distributed, where)
    if verify:
        staging.verify(path, group, distributed)
    return agree(lambda: DcpReader(path) if kind is Kind.DCP else SafetensorsReader(path, kind), group,
                 distributed, where)


def _located(path: str | os.PathLike) -> tuple[Path, Kind]:
    found = staging.resolve(path)
    return found, kind_of(found)


def _groups(model: nn.Module) -> dict[str, list[str]]:
    """Every tensor's first name -> all its names (a tied weight has several; a checkpoint may hold any one)."""
    groups: dict[str, list[str]] = {}
    for name, first in tensor_aliases(model).items():
        groups.setdefault(first, []).append(name)
    return groups


def expected_tensors(model: nn.Module) -> list[Expected]:
    """What a checkpoint of ``model`` should hold: every tensor (by first name, with all its names), its shape and
    dtype; parameters and the buffers its state dict holds are required, meta tensors are needed regardless."""
    tensors = dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers(remove_duplicate=False))
    params = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    persistent = set(model.state_dict(keep_vars=True))
    return [Expected(first, tuple(names), tuple(tensors[first].shape), tensors[first].dtype,
                     required=any(n in params or n in persistent for n in names), meta=tensors[first].is_meta,
                     buffer=first not in params)
            for first, names in _groups(model).items()]


def check_covers(model: nn.Module, reader, where: str, strict: bool = True) -> dict[str, str]:
    """Each of the model's tensors (by first name) -> the name the checkpoint holds it under.

    Every tensor found must have the model's shape and kind of dtype, every tensor on the meta device must be in
    the checkpoint, and (``strict``) every parameter and saved buffer too; one ``CheckpointError`` lists every
    mismatch."""
    return match(expected_tensors(model), reader.shapes, reader.dtypes, where, strict)


def checkpoint_source(path: str | os.PathLike, model: nn.Module, show: bool, strict: bool = True,
                      verify: bool = True, group=None, distributed: bool = False) -> Source:
    """A tensor source reading each rank's slices from the checkpoint at ``path`` (its files verified against
    its manifest and its tensors checked against ``model`` first, agreed over ``group``: call it on every rank);
    tensors the checkpoint lacks come from the model itself. ``show`` draws a progress bar."""
    reader = open_reader(path, group, distributed, verify)
    found = agree(lambda: check_covers(model, reader, f"checkpoint {str(path)!r}", strict), group, distributed,
                  f"checking the checkpoint {str(path)!r}")
    # Agreed too: unverified, a damaged file can fail one rank's reads alone, and its peers must not go on.
    return lambda wants: agree(lambda: read_wants(reader, found, wants, f"loading {Path(path).name}", show), group,
                               distributed, f"reading the checkpoint {str(path)!r}")


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
