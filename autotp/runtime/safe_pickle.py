"""Reading the pickles inside a torch.distributed.checkpoint (DCP) directory without running what they hold.

DCP stores its ``.metadata`` with ``pickle`` and torch's ``FileSystemReader`` reads it with ``pickle.load``: a
``.metadata`` file from someone else could run any code. ``SafeFileSystemReader`` reads it with an unpickler that
admits only DCP's own metadata classes and the torch values they legitimately hold (``torch.Size``, dtypes,
layouts, memory-format codes, the ``Path`` of the checkpoint id), and checks that every file the metadata names
lies inside the checkpoint folder. Objects saved beside the tensors (an optimizer's ``param_groups``) are read
with ``torch.load(weights_only=True)``, which admits numbers, strings, containers and tensors only.
"""

from __future__ import annotations

import io
import os
import pickle
import re
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from autotp.errors import CheckpointError

_METADATA = "torch.distributed.checkpoint.metadata"
_ALLOWED = {(_METADATA, name) for name in (
    "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
    "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # maps a layout's name to torch's layout object, nothing else
    ("collections", "OrderedDict"),
    *((module, cls) for module in ("pathlib", "pathlib._local")  # the checkpoint id DCP records
      for cls in ("Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath", "PureWindowsPath")),
}
"""(module, name) pairs a DCP ``.metadata`` pickle may name: what torch's own ``FileSystemWriter`` writes."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) in _ALLOWED or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of torch.distributed.checkpoint's metadata")


def inside(folder: str | os.PathLike, relative, what: str) -> Path:
    """``folder / relative`` for a file name a checkpoint gives (``what`` says where it was found), refused with
    ``CheckpointError`` when it is not a relative path that stays inside ``folder``.

    Checked on the names themselves, not on resolved links: a Hugging Face cache's snapshot folders hold links
    into its blob store, which are the folder's own files.
    """
    if not isinstance(relative, str) or not relative or "\x00" in relative:
        raise CheckpointError(f"{what} names the file {relative!r}, which is not a file name; a checkpoint names "
                              "files inside its own folder")
    normal = os.path.normpath(relative)
    if os.path.isabs(relative) or normal == os.pardir or normal.startswith(os.pardir + os.sep) or normal == ".":
        raise CheckpointError(f"{what} names {relative!r}, a path outside the checkpoint folder {str(folder)!r}; "
                              "refused (a checkpoint may only name files inside its folder): fix or regenerate it")
    return Path(folder) / normal


def load_metadata(path: str | os.PathLike) -> Metadata:
    """The ``Metadata`` pickled in the DCP ``.metadata`` file at ``path``, read with the restricted unpickler;
    ``CheckpointError`` for anything else in it."""
    try:
        with open(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except pickle.UnpicklingError as e:
        raise CheckpointError(f"{path} holds more than torch.distributed.checkpoint metadata ({e}); refused, as "
                              "unpickling it could run code: load only checkpoints pm.save or DCP wrote") from e
    except (EOFError, ValueError, TypeError, AttributeError, IndexError, KeyError) as e:  # a malformed pickle
        raise CheckpointError(f"{path} is not readable DCP metadata ({type(e).__name__}: {e}); the file is damaged "
                              "or the save that wrote it did not finish") from e
    if not isinstance(metadata, Metadata) or not isinstance(metadata.state_dict_metadata, dict):
        raise CheckpointError(f"{path} holds a {type(metadata).__name__}, not torch.distributed.checkpoint "
                              "metadata; pass a checkpoint pm.save or DCP wrote")
    return metadata


class SafeFileSystemReader(FileSystemReader):
    """torch's ``FileSystemReader`` whose metadata is read by ``load_metadata`` (no code runs) and whose data
    files must lie inside the checkpoint folder."""

    def read_metadata(self, *args, **kwargs) -> Metadata:
        """The checkpoint's metadata, unpickled with only DCP's metadata classes admitted."""
        metadata = load_metadata(self._get_metadata_path(kwargs.get("rank")))
        for index, info in (metadata.storage_data or {}).items():
            where = f"{self.path}/.metadata (for {getattr(index, 'fqn', index)})"
            inside(self.path, getattr(info, "relative_path", None), where)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id  # as torch's reader does
        return metadata


def load_object(value: io.BytesIO, name: str):
    """An object DCP stored as bytes (an optimizer's ``param_groups``), admitting only numbers, strings,
    containers and tensors (``torch.load(weights_only=True)``)."""
    try:
        return torch.load(value, weights_only=True)
    except pickle.UnpicklingError as e:
        # torch's message advises weights_only=False; say only what was refused (its "Unsupported global" line).
        found = re.search(r"Unsupported global: GLOBAL (\S+)", str(e))
        what = f"{found.group(1)} is not allowed" if found else str(e).strip().splitlines()[-1]
        raise CheckpointError(f"the checkpoint's {name} holds objects other than numbers, strings, containers and "
                              f"tensors ({what}); refused, as loading them could run code") from e
