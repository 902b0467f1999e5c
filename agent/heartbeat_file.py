"""The heartbeat file: one small shared-memory record per worker, written by the worker, read by the agent.

Why a file and not a pipe or the store: a heartbeat must cost the training loop microseconds and
must never block, even when the agent is busy or gone. The worker maps the file once and each beat
is a single ``struct.pack_into`` into shared memory; no system call, no lock, no torch. The agent
reads the record whenever it likes and compares the timestamp with its own ``time.monotonic_ns()``
(CLOCK_MONOTONIC is one clock for the whole machine, so both processes see the same time).

This module is the one definition of the layout; both sides import it.

Layout (little-endian, 24 bytes, every field 8-byte aligned)::

    offset 0   8 bytes  MAGIC  b"RALLYHB1"   written once by the agent, checked by the worker
    offset 8   uint64   count  number of beats so far (0 = the worker has not beaten yet)
    offset 16  uint64   ns     time.monotonic_ns() of the last beat (0 = never)

A reader may see the count of one beat and the time of the next (the two words are not written
as one atomic unit). That is harmless for hang detection, which only asks "how long ago".
"""

from __future__ import annotations

import mmap
import os
import struct
import time
from pathlib import Path

MAGIC = b"RALLYHB1"
HEADER = struct.Struct("<8s")
BEAT = struct.Struct("<QQ")
BEAT_OFFSET = HEADER.size
SIZE = HEADER.size + BEAT.size


class HeartbeatFileError(RuntimeError):
    """The file is missing, too short or not a rally heartbeat file."""


def create(path: str | os.PathLike[str]) -> Path:
    """Create (or replace) an empty heartbeat file at ``path`` for one worker; called by the agent.

    The file is written beside its final name and renamed into place, so it gets a fresh inode:
    a worker of a previous round that still has the old file mapped keeps writing to the old,
    unlinked inode instead of hitting SIGBUS on a truncated mapping, and never disturbs the new one.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        f.write(HEADER.pack(MAGIC) + BEAT.pack(0, 0))
    os.replace(tmp, path)
    return path


def read(path: str | os.PathLike[str]) -> tuple[int, int]:
    """Return ``(count, monotonic_ns)`` of the last beat; ``(0, 0)`` if the worker never beat.

    Called by the agent. An ordinary read sees the worker's mapped writes because both go through
    the same page cache.
    """
    try:
        with open(path, "rb") as f:
            data = f.read(SIZE)
    except FileNotFoundError:
        raise HeartbeatFileError(f"heartbeat file {path} does not exist") from None
    _check(path, data)
    count, ns = BEAT.unpack_from(data, BEAT_OFFSET)
    return count, ns


class HeartbeatWriter:
    """The worker's side: maps the file once, then each :meth:`beat` is one write to shared memory.

    Not thread-safe and not meant to be: one training loop beats. After a ``fork`` the child shares
    the mapping, so only the worker process itself should beat (not e.g. data-loader children).
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        try:
            fd = os.open(self.path, os.O_RDWR)
        except FileNotFoundError:
            raise HeartbeatFileError(
                f"heartbeat file {self.path} does not exist (RALLY_HEARTBEAT_FILE is set by the agent; "
                "unset it when running the script by hand)"
            ) from None
        try:
            if os.fstat(fd).st_size < SIZE:
                raise HeartbeatFileError(f"heartbeat file {self.path} is shorter than {SIZE} bytes")
            self._map = mmap.mmap(fd, SIZE, access=mmap.ACCESS_WRITE)
        finally:
            os.close(fd)  # the mapping keeps the file alive
        _check(self.path, self._map[:SIZE])
        # Continue the existing count so the agent's view stays monotonic if a writer is reopened.
        self._count: int = BEAT.unpack_from(self._map, BEAT_OFFSET)[0]

    def beat(self) -> None:
        """Record one beat: increment the count and store the current monotonic time."""
        self._count += 1
        BEAT.pack_into(self._map, BEAT_OFFSET, self._count, time.monotonic_ns())

    def close(self) -> None:
        """Unmap the file; further beats raise ``ValueError``."""
        self._map.close()


def _check(path: str | os.PathLike[str], data: bytes) -> None:
    """Refuse files that are not heartbeat files, so a wrong path fails loudly instead of scribbling."""
    if len(data) < SIZE or data[: HEADER.size] != MAGIC:
        raise HeartbeatFileError(f"{path} is not a rally heartbeat file (expected {SIZE} bytes starting {MAGIC!r})")
