"""Atomic saves: a checkpoint is written beside its place and swapped in only once complete.

``pm.save(DIR)`` writes into ``DIR.autotp-partial``; when every rank has finished, the manifest is recorded
(``manifest.record``) and the first rank swaps it in: the checkpoint already at ``DIR`` (if any) is renamed to
``DIR.autotp-previous``, the new one to ``DIR``, then the previous one is removed. A crash at any moment leaves
a complete checkpoint: before the swap the old ``DIR`` is untouched; between the two renames only
``DIR.autotp-previous`` exists, which ``resolve`` loads in its place. A load of a save that did not finish
says so instead of failing on a missing file.
"""

from __future__ import annotations

import fnmatch
import os
import shutil
from collections.abc import Callable
from pathlib import Path

from autotp.errors import CheckpointError
from autotp.runtime import manifest
from autotp.runtime.manifest import agree

PARTIAL = ".autotp-partial"
PREVIOUS = ".autotp-previous"
_CHECKPOINT_FILES = (".metadata", "__*.metadata", "*.distcp", "*.safetensors", "model.safetensors.index.json",
                     "config.json", "generation_config.json", manifest.MANIFEST)
"""Files a save may replace: what DCP and a Hugging Face export write. Anything else in the folder (logs, a
tokenizer) belongs to someone, and a save there is refused rather than deleting it."""


def sibling(target: Path, suffix: str) -> Path:
    """``target`` with ``suffix`` added to its name (the partial or previous copy of a checkpoint)."""
    return target.with_name(target.name + suffix)


def _check_replaceable(target: Path) -> None:
    """A save may replace ``target`` only if it is absent, empty or a checkpoint (nothing else is lost)."""
    if target.name.endswith((PARTIAL, PREVIOUS)):
        raise CheckpointError(f"{target} is a name autotp keeps for the partial or previous copy of a checkpoint; "
                              "save under another name")
    if not target.exists():
        return
    if not target.is_dir():
        raise CheckpointError(f"cannot save a checkpoint at {target}: it is a file; pass a directory path")
    if (target / manifest.MANIFEST).is_file():
        return
    foreign = sorted(p.name for p in target.iterdir()
                     if not p.is_file() or not any(fnmatch.fnmatch(p.name, pattern) for pattern in _CHECKPOINT_FILES))
    if foreign:
        raise CheckpointError(f"cannot save at {target}: the directory holds files that are not a checkpoint's "
                              f"({', '.join(foreign[:4])}{' ...' if len(foreign) > 4 else ''}), and a save replaces "
                              "the whole directory; save into a new or empty directory")


def _sync_folder(folder: Path) -> None:
    """Make renames in ``folder`` durable (POSIX; elsewhere a no-op)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _remove(path: Path) -> None:
    """Delete a checkpoint folder (a link to one: the link alone, never what it points to)."""
    if path.is_symlink() or path.is_file():
        path.unlink()
    else:
        shutil.rmtree(path)


def _swap(partial: Path, target: Path) -> None:
    """Put the complete ``partial`` at ``target``, keeping the old checkpoint until the new one is in place."""
    previous = sibling(target, PREVIOUS)
    if target.exists():
        if previous.exists() or previous.is_symlink():  # left by a swap stopped after its second rename
            _remove(previous)
        os.rename(target, previous)
    os.rename(partial, target)
    _sync_folder(target.parent)
    if previous.exists() or previous.is_symlink():
        _remove(previous)


def _fresh(partial: Path) -> None:
    """An empty ``partial`` folder (what an earlier save that did not finish left there is removed)."""
    if partial.exists() or partial.is_symlink():
        _remove(partial)
    partial.mkdir(parents=True)


def write_atomically(path: str | os.PathLike, write: Callable[[Path], None], group, distributed: bool,
                     first: bool) -> None:
    """Run ``write(folder)`` (every rank; collective or the first rank's alone) into a fresh partial folder,
    record the manifest and swap the folder in at ``path`` once every rank of ``group`` has finished."""
    target = Path(os.path.abspath(path))
    _check_replaceable(target)  # on every rank, before anything is written: all refuse alike
    partial = sibling(target, PARTIAL)
    # Each step is agreed (a collective): a failure on one rank (a full disk under the first rank's export) fails
    # every rank instead of leaving the others waiting. The agreements also order the steps: the folder exists
    # before anyone writes, every rank's files are written before they are listed, and no rank returns before
    # the swap.
    agree(lambda: _fresh(partial) if first else None, group, distributed, f"saving {target}")
    agree(lambda: write(partial), group, distributed, f"saving {target}")
    manifest.record(partial, group, distributed, first)
    agree(lambda: _swap(partial, target) if first else None, group, distributed, f"saving {target}")


def resolve(path: str | os.PathLike) -> Path:
    """The folder or file to load for ``path``: ``path`` itself, or its previous copy when a swap was
    interrupted; a ``CheckpointError`` saying so when ``path`` is a save that did not finish."""
    p = Path(path)
    if p.name.endswith(PARTIAL):
        raise CheckpointError(f"{p} holds a save that did not finish (autotp writes a checkpoint there and renames it "
                              f"into place once complete); load {p.with_name(p.name[:-len(PARTIAL)])} or an earlier "
                              "checkpoint")
    if not p.exists():
        previous = sibling(p, PREVIOUS)
        if (previous / manifest.MANIFEST).is_file():
            return previous  # the swap stopped between its renames: this is the checkpoint that was at ``path``
        if sibling(p, PARTIAL).exists():
            raise CheckpointError(f"checkpoint {str(path)!r} does not exist: a save to it did not finish (its partial "
                                  f"files are in {sibling(p, PARTIAL)}); load an earlier checkpoint or save again")
        return p
    if p.is_dir() and not (p / ".metadata").exists() and any(p.glob("*.distcp")):
        raise CheckpointError(f"{str(path)!r} holds DCP shards but no .metadata, which a save writes last: this save "
                              "did not finish; load an earlier checkpoint or save again")
    return p


def verify(path: Path, group, distributed: bool) -> bool:
    """Check the files a load of the checkpoint at ``path`` reads against its manifest: every file of a DCP
    folder, the tensors and index of a safetensors export (its ``config.json`` is the user's to edit), or the
    single file named; collective over ``group``. Returns whether a manifest was found."""
    if path.is_file():
        return manifest.verify(path.parent, group, distributed, only=lambda name: name == path.name)
    if (path / ".metadata").is_file():
        return manifest.verify(path, group, distributed)
    return manifest.verify(path, group, distributed, only=lambda name: name.endswith((".safetensors", ".index.json")))
