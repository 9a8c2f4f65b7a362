"""A checkpoint's manifest: each file's size and checksum, written last by a save and checked on load.

``pm.save`` (both formats) lists every file it wrote in ``autotp-manifest.json`` with its size and CRC-32
(zlib's: about 4 GB/s on one core, so checking is cheap next to reading; it catches truncation, flipped bytes
and files swapped in from another save). On load the files are checked before anything is unpickled or read,
each file by one rank of the group (the work is shared), and every rank then raises the same
``CheckpointError`` naming every damaged or missing file, so no rank loads while another fails.
"""

from __future__ import annotations

import json
import os
import zlib
from collections.abc import Callable
from pathlib import Path

import torch.distributed as dist

from autotp.errors import CheckpointError
from autotp.runtime.safe_pickle import inside

MANIFEST = "autotp-manifest.json"
FORMAT = "autotp checkpoint manifest"
VERSION = 1
ALGORITHM = "crc32"
_BLOCK = 16 * 2**20


def checksum(path: str | os.PathLike) -> dict:
    """``{"size": bytes, "crc32": hex}`` of the file at ``path``, read in blocks."""
    crc, size = 0, 0
    with open(path, "rb") as f:
        while block := f.read(_BLOCK):
            crc, size = zlib.crc32(block, crc), size + len(block)
    return {"size": size, ALGORITHM: f"{crc:08x}"}


def files_in(folder: str | os.PathLike) -> list[str]:
    """Every file under ``folder`` (relative, ``/``-separated, sorted), the manifest itself left out."""
    root = Path(folder)
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file() and p.name != MANIFEST)


def describe(folder: str | os.PathLike, names: list[str]) -> dict[str, dict]:
    """Each named file's size and checksum."""
    return {name: checksum(Path(folder) / name) for name in names}


def write(folder: str | os.PathLike, files: dict[str, dict]) -> None:
    """Write the manifest of ``files`` into ``folder`` (a temporary name, synced, then renamed: never half)."""
    text = json.dumps({"format": FORMAT, "version": VERSION, "algorithm": ALGORITHM, "files": files}, indent=1,
                      sort_keys=True)
    path = Path(folder) / MANIFEST
    partial = path.with_suffix(".tmp")
    with open(partial, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(partial, path)


def read(folder: str | os.PathLike) -> dict[str, dict] | None:
    """The files the manifest in ``folder`` lists (name -> size and checksum), or None when there is none.

    The manifest is JSON checked field by field: a damaged or foreign one is a ``CheckpointError``, and every
    name must stay inside ``folder``."""
    path = Path(folder) / MANIFEST
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path} is not a readable manifest ({e}); the checkpoint is damaged: load an "
                              "earlier one, or pass verify=False to load without checking its files") from e
    files = data.get("files") if isinstance(data, dict) else None
    if (not isinstance(data, dict) or data.get("format") != FORMAT or data.get("algorithm") != ALGORITHM
            or not isinstance(files, dict)):
        raise CheckpointError(f"{path} is not an autotp {ALGORITHM} manifest of version {VERSION}; the checkpoint is "
                              "damaged or from another tool: load an earlier one, or pass verify=False")
    for name, entry in files.items():
        inside(folder, name, str(path))
        if (not isinstance(entry, dict) or not isinstance(entry.get("size"), int)
                or not isinstance(entry.get(ALGORITHM), str)):
            raise CheckpointError(f"{path} lists {name!r} without a size and a {ALGORITHM}; the manifest is damaged")
    return files


def problems(folder: str | os.PathLike, files: dict[str, dict], names: list[str]) -> list[str]:
    """What is wrong with each of ``names`` (listed in ``files``) in ``folder``: missing, another size, or
    other contents; empty when they are as the save wrote them."""
    out = []
    for name in names:
        want, path = files[name], Path(folder) / name
        if not path.is_file():
            out.append(f"{name} is missing")
            continue
        try:  # an unreadable file is reported like a damaged one, so every rank still reaches the gather
            size = path.stat().st_size
            if size != want["size"]:
                out.append(f"{name} has {size} bytes where the save wrote {want['size']} (truncated or overwritten)")
            elif checksum(path)[ALGORITHM] != want[ALGORITHM]:
                out.append(f"{name} does not hold the bytes the save wrote (its {ALGORITHM} differs: damaged)")
        except OSError as e:
            out.append(f"{name} cannot be read ({e.strerror or e})")
    return out


def rank_and_size(group, distributed: bool) -> tuple[int, int]:
    """This process's rank in ``group`` and the group's size (0 and 1 without a process group)."""
    if not distributed:
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def gather(value, group, distributed: bool) -> list:
    """``value`` from every rank of ``group``, in rank order (a collective; ``[value]`` alone)."""
    if not distributed:
        return [value]
    out: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, value, group=group)
    return out


def verify(folder: str | os.PathLike, group, distributed: bool, only: Callable[[str], bool] | None = None) -> bool:
    """Check the files the manifest in ``folder`` lists (those ``only`` accepts, if given) against it, each file on
    one rank of ``group``; a collective when ``distributed``. Every rank raises the same ``CheckpointError``
    naming every file that is missing or differs. Returns whether there was a manifest to check."""
    files = read(folder)
    if files is None:
        return False
    names = sorted(n for n in files if only is None or only(n))
    rank, size = rank_and_size(group, distributed)
    found = [p for mine in gather(problems(folder, files, names[rank::size]), group, distributed) for p in mine]
    if found:
        raise CheckpointError(f"checkpoint {str(folder)!r} is damaged: {'; '.join(found)}. Load an earlier "
                              "checkpoint (or pass verify=False to load it unchecked)")
    return True


def record(folder: str | os.PathLike, group, distributed: bool, first: bool) -> None:
    """Write the manifest of every file in ``folder``, each checksummed by one rank of ``group`` and the
    manifest written by the ``first`` rank (a collective when ``distributed``)."""
    rank, size = rank_and_size(group, distributed)
    names = files_in(folder)
    entries = {k: v for part in gather(describe(folder, names[rank::size]), group, distributed)
               for k, v in part.items()}
    if first:
        write(folder, entries)


def agree(run, group, distributed: bool, what: str):
    """``run()`` on every rank of ``group``, failing on every rank if it failed on any (a collective when
    ``distributed``): a rank whose own ``run`` failed raises its error, the others a ``CheckpointError`` naming
    the rank and its error, so no rank goes on with a checkpoint another could not read."""
    error, result = None, None
    try:
        result = run()
    except Exception as e:  # noqa: BLE001 - told to every rank, then raised again below
        error = e
    told = gather(None if error is None else f"{type(error).__name__}: {error}", group, distributed)
    failed = [(rank, message) for rank, message in enumerate(told) if message is not None]
    if error is not None:
        raise error
    if failed:
        listing = "; ".join(f"rank {rank}: {message}" for rank, message in failed)
        raise CheckpointError(f"{what} failed on {len(failed)} other rank(s), so no rank goes on: {listing}")
    return result
