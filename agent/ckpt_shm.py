"""The memory tier's shared-memory layout: where a node's checkpoint copies live and how a worker fills one.

One directory per agent, private to the job's user, holds everything of the tier::

    /dev/shm/rally-ckpt-<agent token>/          mode 0700, created and removed by the holder
        holder.sock                             the holder's socket (agent/ckpt_holder.py)
        <key>.0  <key>.1                        two slots per key: at most two copies per rank

A key names whose copy it is (``whole`` for a DDP state saved by local rank 0, ``rank<N>`` for a
rank's own shard). A slot file holds exactly the bytes ``torch.save`` writes for the state: the
zip archive that ``torch.load`` reads (per-record CRC-32 left out, see below). So a reload is
``torch.load(slot, mmap=True)`` (no parsing of a format of our own, no copy until the script
copies the tensors into its model), and persisting is a byte copy with rally's footer appended
(agent/checkpoint_file.py): the file on disk is what ``job.save`` always wrote.

Why ``torch.save`` into a preallocated mapping: the pages of a slot are allocated once (the holder
``posix_fallocate``s them, so a /dev/shm too small is found at reservation, not as a SIGBUS in
the middle of a copy) and mapped once per worker (MAP_POPULATE); writing the archive into them is
one memcpy per tensor. Measured here for 400 MB: 0.024 s against 0.042 s for ``copy_`` into
preallocated tensors. The zip records' own CRC-32 is not computed (``compute_crc32=False``):
it would be a second pass over the bytes inside the training step's stall; rally's footer CRC,
computed by the persister while it copies, protects the durable file instead.

Imports no torch at module level: the holder and the agent use the names and the cleanup only.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import re
import shutil
from pathlib import Path
from typing import Any

SHM_ROOT_ENV = "RALLY_SHM_ROOT"
"""Where tier directories are made (default /dev/shm); tests and unusual hosts may point it elsewhere."""
DIR_PREFIX = "rally-ckpt-"
SOCKET_NAME = "holder.sock"
SLOTS_PER_KEY = 2
_KEY_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


def shm_root() -> Path:
    return Path(os.environ.get(SHM_ROOT_ENV) or "/dev/shm")


def tier_dir(token: str, root: Path | None = None) -> Path:
    """The directory of the agent whose token is ``token``."""
    return (root or shm_root()) / f"{DIR_PREFIX}{token}"


def slot_path(directory: Path, key: str, slot: int) -> Path:
    if not _KEY_RE.match(key) or slot not in range(SLOTS_PER_KEY):
        raise ValueError(f"rally: bad memory-tier slot {key!r}/{slot}")
    return directory / f"{key}.{slot}"


def valid_key(key: str) -> bool:
    return bool(_KEY_RE.match(key))


def remove_tier(token: str, root: Path | None = None) -> None:
    """Delete an agent's whole tier directory (slots and socket); nothing if it is gone already."""
    with contextlib.suppress(FileNotFoundError):
        shutil.rmtree(tier_dir(token, root))


def leftovers(root: Path | None = None) -> list[Path]:
    """Tier directories present under the root: what a finished job must not leave behind."""
    try:
        return sorted(p for p in (root or shm_root()).iterdir() if p.name.startswith(DIR_PREFIX))
    except FileNotFoundError:
        return []


# ---------------------------------------------------------------------------------------------
# Worker side: the archive's size, and the copy into a slot


class _Sink:
    """The file-like object torch.save writes its archive to: a mapping, or nothing (sizing)."""

    def __init__(self, target: mmap.mmap | None) -> None:
        self.target = target
        self.pos = 0
        self.end = 0

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        n = view.nbytes
        if self.target is not None:
            if self.pos + n > len(self.target):
                raise ValueError("rally: the state grew while it was being checkpointed")
            self.target[self.pos : self.pos + n] = view
        self.pos += n
        self.end = max(self.end, self.pos)
        return n

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self.pos, os.SEEK_END: self.end}[whence]
        self.pos = base + offset
        return self.pos

    def flush(self) -> None:
        pass


@contextlib.contextmanager
def _no_record_crc() -> Any:
    from torch.utils.serialization import config

    before = config.save.compute_crc32
    config.save.compute_crc32 = False
    try:
        yield
    finally:
        config.save.compute_crc32 = before


def archive_size(state: Any) -> int:
    """The exact length of the archive torch.save writes for ``state``: a pass that copies nothing."""
    import torch

    sink = _Sink(None)
    with _no_record_crc():
        torch.save(state, sink)
    return sink.end


class SlotMaps:
    """A worker's mappings of its slots, made once per slot file and reused for every save."""

    def __init__(self) -> None:
        self._maps: dict[str, tuple[int, mmap.mmap]] = {}

    def mapping(self, path: str, size: int) -> mmap.mmap:
        """The slot at ``path`` mapped read-write; a new mapping when the holder replaced the file."""
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        try:
            info = os.fstat(fd)
            cached = self._maps.get(path)
            if cached is not None and cached[0] == info.st_ino and len(cached[1]) >= size:
                return cached[1]
            if cached is not None:
                with contextlib.suppress(BufferError):
                    cached[1].close()
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)  # fault every page in now, once
            mapped = mmap.mmap(fd, info.st_size, flags=flags)
            self._maps[path] = (info.st_ino, mapped)
            return mapped
        finally:
            os.close(fd)


def write_archive(state: Any, target: mmap.mmap) -> int:
    """torch.save ``state`` into ``target`` (a slot mapping); return the archive's length."""
    import torch

    sink = _Sink(target)
    with _no_record_crc():
        torch.save(state, sink)
    return sink.end
