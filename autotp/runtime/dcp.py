"""torch.distributed.checkpoint (DCP) for tensors held as several chunks per rank, keyed by original names.

DCP records every tensor under its name with its full (global) size and the chunks each rank wrote, each at
its global offsets; a reader asks for the chunks it needs and DCP reads the overlapping parts of whatever was
written (resharding). DTensor and ShardedTensor describe one chunk per rank (or ShardedTensor, which torch
deprecates, several); a fused QKV weight split per segment is several chunks per rank, so autotp hands DCP
``Sharded`` values through its own planners: each write item is one chunk, at its global offsets. The files are
plain DCP: any layout reads them back, and DCP's own tools (``dcp_to_torch_save``) read them too.
"""

from __future__ import annotations

import io
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import (
    DefaultLoadPlanner,
    DefaultSavePlanner,
)
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    ReadItem,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import (
    create_read_items_for_chunk_list,
)

from autotp.errors import AutotpError, CheckpointError
from autotp.passes.placement import Part
from autotp.runtime.safe_pickle import SafeFileSystemReader, load_object


@dataclass
class Sharded:
    """One rank's chunks of a tensor: its full size and, per chunk, the global offsets and the values there."""

    size: tuple[int, ...]
    chunks: list[tuple[tuple[int, ...], torch.Tensor]]

    @classmethod
    def of(cls, local: torch.Tensor, part: Part) -> Sharded:
        """The chunks of a rank's tensor ``local`` holding ``part`` (views: loading into them fills ``local``)."""
        return cls(part.shape, [(offsets, view) for (offsets, _), view in zip(part.chunks(), part.views(local))])

    def at(self, offsets) -> torch.Tensor:
        """The chunk at global ``offsets``."""
        for at, tensor in self.chunks:
            if tuple(at) == tuple(offsets):
                return tensor
        raise KeyError(f"no chunk at offsets {tuple(offsets)}")


def _chunk(offsets, tensor: torch.Tensor) -> ChunkStorageMetadata:
    return ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=tensor.size())


class ShardedSavePlanner(DefaultSavePlanner):
    """Writes every chunk of every ``Sharded`` value at its global offsets; other values as bytes.

    A chunk several ranks hold (a replicated tensor, or a weight two pipeline stages share) is written once:
    DCP's deduplication keeps one write per (name, offsets).
    """

    def __init__(self):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def create_local_plan(self) -> SavePlan:
        items = []
        for fqn, value in self.state_dict.items():
            if not isinstance(value, Sharded):
                items.append(WriteItem(index=MetadataIndex(fqn), type=WriteItemType.BYTE_IO))
                continue
            for offsets, tensor in value.chunks:
                data = TensorWriteData(chunk=_chunk(offsets, tensor), size=torch.Size(value.size),
                                       properties=TensorProperties.create_from_tensor(tensor))
                items.append(WriteItem(index=MetadataIndex(fqn, offsets), type=WriteItemType.SHARD, tensor_data=data))
        self.plan = SavePlan(items)
        return self.plan

    def lookup_object(self, index: MetadataIndex):
        value = self.state_dict[index.fqn]
        return value.at(index.offset) if isinstance(value, Sharded) else value


class ShardedLoadPlanner(DefaultLoadPlanner):
    """Reads into every chunk of every ``Sharded`` value the overlapping parts of the saved chunks (DCP's
    resharding); other values are read back as objects. ``on_read(nbytes)`` is told of every tensor read."""

    def __init__(self, on_read: Callable[[int], None] | None = None):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.on_read = on_read

    def set_up_planner(self, state_dict: dict, metadata: Metadata | None = None, is_coordinator: bool = False) -> None:
        # The default planner's set-up makes meta tensors real and drops values of types it does not know
        # (``Sharded``); the chunks here are real tensors already.
        self.original_state_dict = self.state_dict = state_dict
        self.metadata, self.is_coordinator = metadata, is_coordinator

    def create_local_plan(self) -> LoadPlan:
        requests: list[ReadItem] = []
        for fqn, value in self.state_dict.items():
            md = self.metadata.state_dict_metadata[fqn]
            if isinstance(value, Sharded):
                chunks = [_chunk(offsets, tensor) for offsets, tensor in value.chunks]
                requests += create_read_items_for_chunk_list(fqn, md, chunks)
            else:
                requests.append(ReadItem(type=LoadItemType.BYTE_IO, dest_index=MetadataIndex(fqn),
                                         dest_offsets=torch.Size((0,)), storage_index=MetadataIndex(fqn),
                                         storage_offsets=torch.Size((0,)), lengths=torch.Size((0,))))
        return LoadPlan(requests)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        value = self.state_dict[index.fqn]
        chunk = value.chunks[index.index] if index.index is not None and index.index < len(value.chunks) else None
        if chunk is not None and tuple(chunk[0]) == tuple(index.offset):
            return chunk[1]
        return value.at(index.offset)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        self.state_dict[read_item.dest_index.fqn] = load_object(value, read_item.dest_index.fqn)

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        if self.on_read is not None:
            self.on_read(tensor.numel() * tensor.element_size())


def read_metadata(path: str | os.PathLike) -> Metadata:
    """The metadata of the DCP checkpoint at ``path`` (names, full sizes, dtypes, chunks)."""
    try:
        return SafeFileSystemReader(path).read_metadata()
    except OSError as e:
        raise CheckpointError(f"{path} is not a readable torch.distributed.checkpoint directory (its .metadata file "
                              f"could not be read: {e}); pass a checkpoint pm.save wrote") from e


def tensor_metadata(metadata: Metadata) -> dict[str, TensorStorageMetadata]:
    """Every tensor entry of ``metadata`` by name."""
    return {k: v for k, v in metadata.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}


def save(state: dict[str, object], path: str | os.PathLike, group, distributed: bool) -> None:
    """Write ``state`` (``Sharded`` values and picklable objects) as a DCP checkpoint; collective over ``group``."""
    writer = dcp.FileSystemWriter(path, single_file_per_rank=True)
    with warnings.catch_warnings():  # without a group DCP warns that it saves from one process: that is meant
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(state, storage_writer=writer, planner=ShardedSavePlanner(), process_group=group,
                 no_dist=not distributed)


def load(state: dict[str, object], path: str | os.PathLike, on_read: Callable[[int], None] | None = None) -> None:
    """Fill ``state``'s ``Sharded`` chunks (and replace its other values) from the DCP checkpoint at ``path``.

    Each rank reads on its own (no collective): only the saved chunks overlapping its own are read.
    """
    if not state:
        return
    try:
        with warnings.catch_warnings():  # DCP warns that no_dist means one process: that is meant here
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(state, storage_reader=SafeFileSystemReader(path), planner=ShardedLoadPlanner(on_read),
                     no_dist=True)
    except dcp.CheckpointException as e:
        raise _cause(e, path) from e
    except (OSError, RuntimeError, ValueError, EOFError) as e:  # a file missing, short or unreadable
        raise CheckpointError(f"reading the checkpoint {str(path)!r} failed: {type(e).__name__}: {e}; its files "
                              "are damaged or incomplete: load an earlier checkpoint") from e


def _cause(error: Exception, path) -> Exception:
    """The error to raise for DCP's ``CheckpointException``, which wraps each rank's failure: autotp's own
    error as it is, anything else as a ``CheckpointError`` naming the cause."""
    failures = [f[0] if isinstance(f, tuple) else f for f in getattr(error, "failures", {}).values()]
    cause = next((f for f in failures if isinstance(f, BaseException)), error)
    if isinstance(cause, AutotpError):
        return cause
    text = str(cause).strip().splitlines()[0] if str(cause).strip() else "a file ended early"
    return CheckpointError(f"reading the checkpoint {str(path)!r} failed: {type(cause).__name__}: {text}; its files "
                           "are damaged or incomplete: load an earlier checkpoint")
