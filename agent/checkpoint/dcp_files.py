"""Sharded checkpoints on disk: torch.distributed.checkpoint (DCP) directories that rally publishes whole.

A sharded checkpoint is a plain DCP directory, written by torch's own planner and file format
(see :mod:`rally.agent.checkpoint.dcp_storage`), plus one file of rally's, written last::

    step_000000000120.dcp/            published: what load_latest and the crash-loop guard see
        __0_0.distcp  __1_0.distcp    one file per rank: the shards that rank held (torch.save'd)
        .metadata                     DCP's index of every tensor chunk (pickled by torch)
        rally.json                    rally's manifest: each file's size and CRC-32
    .step_000000000120.dcp.<id>.tmp/  a save in progress, locked (flock) by its coordinator

Why a directory renamed into place: a DCP save is written by every rank at once, so there is no
single file to rename. The coordinator (global rank 0) creates the temporary directory, every
rank writes and fsyncs its file there, and only once DCP has gathered every rank's results does
the coordinator write the metadata and the manifest, fsync them, and rename the directory to its
step's name. A crash at any moment leaves the previous steps as they were and, at worst, a
temporary directory that the next save deletes once its lock is free (its coordinator died).

Why a manifest: as for single-file checkpoints (:mod:`rally.agent.worker.checkpoint_file`), whether a
damaged shard loads depends on where the damage is; sizes and CRC-32s give every reader (each
rank, the agent) one verdict from the bytes alone. ``torch.distributed.checkpoint.load`` ignores
``rally.json``, so a published directory is also an ordinary DCP checkpoint.

This module needs only the standard library: the agent's crash-loop check uses it.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import stat
import struct
import sys
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from rally.agent.worker.checkpoint_file import DamagedCheckpoint, _lock, crc32_of, fsync_dir

MANIFEST = "rally.json"
MANIFEST_FORMAT = "rally-dcp-1"
SUFFIX = ".dcp"
STEP_RE = re.compile(r"^step_(\d+)\.dcp$")
TEMP_RE = re.compile(r"^\.step_\d+\.dcp\..*\.tmp$")
_VERDICT_CACHE_LIMIT = 256
SLOT_HEADER = struct.Struct("<8sQQQ")
"""A sharded copy in the memory tier: magic, metadata length, world size, rank (agent/checkpoint/dcp_memory.py)."""
SLOT_MAGIC = b"RALLYDCP"
KEY_RE = re.compile(r"^dcp(r?)(\d+)of(\d+)$")
"""The holder's keys of sharded copies: ``dcp<rank>of<world>`` (own), ``dcpr<rank>of<world>`` (replica)."""


def own_key(rank: int, world: int) -> str:
    """The holder's key for rank ``rank``'s own copy (the world size in it: a copy serves only its layout)."""
    return f"dcp{rank}of{world}"


def replica_key(rank: int, world: int) -> str:
    """The holder's key for the replica of rank ``rank``'s copy, kept on the next node."""
    return f"dcpr{rank}of{world}"


def step_name(step: int) -> str:
    """The published directory's name for ``step``: ``step_<12 digits>.dcp``."""
    return f"step_{step:012d}{SUFFIX}"


def list_steps(directory: Path) -> list[tuple[int, Path]]:
    """Published sharded checkpoints in ``directory``, oldest first; temporary ones never match."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    return sorted((int(m.group(1)), directory / name) for name in names if (m := STEP_RE.match(name)))


def holds_shards(state: Any) -> bool:
    """Whether ``state`` holds a DTensor or ShardedTensor (FSDP2, tensor parallel, FSDP1's SHARDED_STATE_DICT).

    Only modules already imported are asked (no torch import here): a script that never imported
    DTensor holds none.
    """
    kinds = tuple(
        kind
        for module, name in (
            ("torch.distributed.tensor", "DTensor"),
            ("torch.distributed._shard.sharded_tensor", "ShardedTensor"),
        )
        if (kind := getattr(sys.modules.get(module), name, None)) is not None
    )
    if not kinds:
        return False
    pending = [state]
    while pending:
        value = pending.pop()
        if isinstance(value, kinds):
            return True
        if isinstance(value, dict):
            pending.extend(value.values())
        elif isinstance(value, (list, tuple)):
            pending.extend(value)
    return False


# ---------------------------------------------------------------------------------------------
# Writing: a locked temporary directory, published by one rename


class TempDir:
    """A save's temporary directory, locked by the coordinator from creation until publication.

    The lock (an flock on the directory itself) is what tells a live save from a dead one: a
    cleaner deletes a temporary directory only when it can take that lock.
    """

    def __init__(self, directory: Path, step: int) -> None:
        self.parent = directory
        self.step = step
        while True:
            self.path = Path(tempfile.mkdtemp(prefix=f".{step_name(step)}.", suffix=".tmp", dir=directory))
            self._fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY)
            if not _lock(self._fd, blocking=True):
                return  # no locks on this file system: cleaners delete nothing either
            try:
                if os.stat(self.path).st_ino == os.fstat(self._fd).st_ino:
                    return
            except FileNotFoundError:
                pass  # a cleaner took it between mkdtemp and our lock; make another
            os.close(self._fd)

    def publish(self, files: dict[str, tuple[int, int]]) -> Path:
        """Publish this directory as its step (see :func:`publish_dir`); return the new path."""
        self.path = publish_dir(self.parent, self.path, self.step, files)
        return self.path

    def close(self) -> None:
        """Release the lock; an unpublished directory then counts as dead and is deleted by the next save."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def discard(self) -> None:
        """Delete an unpublished directory (the save failed) and release the lock."""
        if TEMP_RE.match(self.path.name):
            shutil.rmtree(self.path, ignore_errors=True)
        self.close()


def publish_dir(directory: Path, temp: Path, step: int, files: dict[str, tuple[int, int]]) -> Path:
    """Write the manifest into ``temp``, make everything durable, rename it to the step's name.

    ``files`` maps each file of the checkpoint (shards and ``.metadata``) to (size, CRC-32).
    An existing directory of the same step (a damaged one this job resumed past) is moved
    aside first and deleted after, so the name never points at a half-written directory.
    """
    manifest = {
        "format": MANIFEST_FORMAT,
        "step": step,
        "files": {n: {"size": s, "crc32": c} for n, (s, c) in sorted(files.items())},
    }
    fd = os.open(temp / MANIFEST, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        os.write(fd, json.dumps(manifest, indent=1).encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    fsync_dir(temp)
    final = directory / step_name(step)
    try:
        os.rename(temp, final)
    except OSError:  # ENOTEMPTY / EEXIST: the step exists already
        trash = _aside(final)
        os.rename(temp, final)
        shutil.rmtree(trash, ignore_errors=True)
    fsync_dir(directory)
    return final


def _aside(path: Path) -> Path:
    """Rename ``path`` to an unlocked temporary name (so it vanishes from listings at once)."""
    trash = Path(tempfile.mktemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    os.rename(path, trash)
    return trash


def remove_dead_saves(directory: Path, only: str | None = None) -> None:
    """Delete temporary directories whose save died (nobody holds their lock); never a live save's.
    ``only``: look at that one name (agent/checkpoint/dcp_persist.py picks older steps' directories)."""
    try:
        names = [only] if only is not None else os.listdir(directory)
    except FileNotFoundError:
        return
    for name in names:
        if not TEMP_RE.match(name):
            continue
        path = directory / name
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        except OSError:
            continue  # renamed or deleted meanwhile, or not a directory of ours
        try:
            if _lock(fd, blocking=False) and os.stat(path).st_ino == os.fstat(fd).st_ino:
                shutil.rmtree(path, ignore_errors=True)
        except OSError:
            pass
        finally:
            os.close(fd)


def prune(directory: Path, keep: int, own_step: int) -> None:
    """Keep the checkpoint of ``own_step`` and the ``keep - 1`` newest older ones; delete the rest.

    Newer directories are not this save's to judge (see :func:`rally.agent.worker.job._prune`). Each
    victim is first renamed to a temporary name, so a listing never shows a half-deleted step.
    """
    older = [path for step, path in list_steps(directory) if step < own_step]
    for path in older[: max(0, len(older) - (keep - 1))]:
        with contextlib.suppress(FileNotFoundError):
            shutil.rmtree(_aside(path), ignore_errors=True)


# ---------------------------------------------------------------------------------------------
# Reading: one verdict from the bytes alone


def manifest_files(path: Path) -> dict[str, tuple[int, int]]:
    """The manifest's files, (size, CRC-32) each, after checking that each exists with its size.

    Cheap (one small read and a stat per file); raises DamagedCheckpoint naming the first problem.
    """
    try:
        with open(path / MANIFEST, "rb") as handle:
            manifest = json.loads(handle.read(1 << 20))
        files = {str(n): (int(v["size"]), int(v["crc32"])) for n, v in manifest["files"].items()}
        if manifest.get("format") != MANIFEST_FORMAT or ".metadata" not in files:
            raise ValueError
    except FileNotFoundError:
        raise DamagedCheckpoint(f"no {MANIFEST}: not a complete rally checkpoint") from None
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        raise DamagedCheckpoint(f"{MANIFEST} is unreadable or malformed") from None
    for name, (size, _) in files.items():
        if "/" in name or name in ("", ".", ".."):
            raise DamagedCheckpoint(f"{MANIFEST} names a file outside the checkpoint: {name!r}")
        try:
            info = os.stat(path / name)
        except OSError:
            raise DamagedCheckpoint(f"{name} is missing") from None
        if not stat.S_ISREG(info.st_mode):
            raise DamagedCheckpoint(f"{name} is not a regular file")
        if info.st_size != size:
            raise DamagedCheckpoint(f"{name} has {info.st_size} bytes, the manifest says {size}")
    return files


def check_checksums(path: Path, files: dict[str, tuple[int, int]], names: Iterable[str]) -> None:
    """Read ``names`` (files of the manifest) end to end and compare their CRC-32s."""
    for name in names:
        size, expected = files[name]
        try:
            with open(path / name, "rb") as handle:
                actual = crc32_of(handle, size, f"{name} is shorter than the manifest says")
        except OSError as exc:
            raise DamagedCheckpoint(f"{name}: read error: {exc.strerror}") from None
        if actual != expected:
            raise DamagedCheckpoint(f"{name}: checksum mismatch: crc32 {actual:08x}, the manifest says {expected:08x}")


def verify(path: Path, share: int = 0, shares: int = 1) -> None:
    """Check a published directory: every file's size, and the CRC-32 of every ``shares``-th file
    from ``share`` on (ranks split the reading, then agree; see dcp_storage). Raises DamagedCheckpoint."""
    if not path.is_dir():
        raise DamagedCheckpoint("not a directory")
    files = manifest_files(path)
    check_checksums(path, files, sorted(files)[share::shares])


_verdicts: dict[tuple[object, ...], bool] = {}


def is_intact(path: Path) -> bool:
    """Whether ``path`` passes a full :func:`verify`, remembered per version of the directory and of
    each file in it (the agent asks every round; published files never change unless damaged)."""
    try:
        key = (
            str(path),
            *_stamp(path),
            *(item for name in sorted(os.listdir(path)) for item in (name, *_stamp(path / name))),
        )
    except OSError:
        return False
    if key not in _verdicts:
        try:
            verify(path)
            verdict = True
        except DamagedCheckpoint:
            verdict = False
        if len(_verdicts) >= _VERDICT_CACHE_LIMIT:
            _verdicts.clear()
        _verdicts[key] = verdict
    return _verdicts[key]


def _stamp(path: Path) -> tuple[int, int, int, int]:
    info = os.stat(path)
    return info.st_dev, info.st_ino, info.st_mtime_ns, info.st_ctime_ns


def newest_intact_step(directory: Path) -> int | None:
    """The newest published step that verifies (the agent's crash-loop check); None if none does."""
    for step, path in reversed(list_steps(directory)):
        if is_intact(path):
            return step
    return None
