"""The heartbeat file: one small shared-memory record per worker, written by the worker, read by the agent.

Why a file and not a pipe or the store: a heartbeat must cost the training loop microseconds and
must never block, even when the agent is busy or gone. The worker maps the file once and each beat
is a single `struct.pack_into` into shared memory; no system call, no lock, no torch. The agent
reads the record whenever it likes and compares the timestamp with its own `time.monotonic_ns()`
(CLOCK_MONOTONIC is one clock for the whole machine, so both processes see the same time).

This module is the one definition of the layout; both sides import it (standard library only).

Layout (little-endian, 224 bytes, fixed size, every field 8-byte aligned)::

    offset 0   8 bytes  MAGIC  b"RALLYHB3"   written once by the agent, checked by the worker
    -- the beat: one pack_into per heartbeat(step=N) --
    offset 8   uint64   count  number of beats so far (0 = the worker has not beaten yet)
    offset 16  uint64   ns     time.monotonic_ns() of the last beat (0 = never)
    offset 24  int64    step   the step number given with that beat (-1 = none given)
    -- the section: one pack_into per entry to or exit from job.section(...) --
    offset 32  uint64   changed_ns   monotonic ns of the last section entry or exit (0 = never)
    offset 40  uint64   entered_ns   monotonic ns at which the current section was entered
    offset 48  uint64   timeout_ns   the current section's own timeout (0 = none)
    offset 56  uint64   reserved
    offset 64  64 bytes name         the current section's name, UTF-8, NUL-padded ("" = none)
    -- what `--heartbeat-timeout auto` learns from (agent/observe/learned_timeouts.py), kept by the worker
       because the agent reads only now and then and would miss the longest gap --
    offset 128 uint64   intervals    beat intervals measured so far
    offset 136 uint64   longest_ns   the longest: from the later of the previous beat and the last
                                     section change (the agent's own clock for a hang) to a beat
    offset 144 uint64   seq          top-level sections without a timeout completed so far
    offset 152 uint64   count        how often the section named below completed
    offset 160 uint64   longest_ns   its longest duration
    offset 168 uint64   reserved
    offset 176 48 bytes name         the section that completed last, UTF-8, NUL-padded

A reader may see the count of one beat and the time of the next, or half of a section change
(each group is one `pack_into`, but a reader's `read` is not atomic against it). That is
harmless for the beat, which only answers "how long ago"; a hang judged from a section is
confirmed by a second read before anyone is killed (see agent/observe/health.py).
"""

from __future__ import annotations

import mmap
import os
import struct
import time
from dataclasses import dataclass
from pathlib import Path

from rally.agent.base.untrusted_files import UntrustedFile, read_capped

MAGIC = b"RALLYHB3"
HEADER = struct.Struct("<8s")
BEAT = struct.Struct("<QQq")
SECTION = struct.Struct("<QQQQ64s")
LEARN_BEAT = struct.Struct("<QQ")
LEARN_SECTION = struct.Struct("<QQQQ48s")
BEAT_OFFSET = HEADER.size
SECTION_OFFSET = BEAT_OFFSET + BEAT.size
LEARN_BEAT_OFFSET = SECTION_OFFSET + SECTION.size
LEARN_SECTION_OFFSET = LEARN_BEAT_OFFSET + LEARN_BEAT.size
SIZE = LEARN_SECTION_OFFSET + LEARN_SECTION.size
NO_STEP = -1
SECTION_NAME_BYTES = 64


class HeartbeatFileError(RuntimeError):
    """The file is missing, too short or not a rally heartbeat file."""


@dataclass(frozen=True)
class HeartbeatRecord:
    """One read of a worker's heartbeat file (all times are CLOCK_MONOTONIC nanoseconds)."""

    count: int = 0
    ns: int = 0
    step: int | None = None
    section: str = ""
    section_entered_ns: int = 0
    section_timeout_ns: int = 0
    section_changed_ns: int = 0
    intervals: int = 0  # beat intervals the worker measured (what --heartbeat-timeout auto learns from)
    longest_interval_ns: int = 0
    done_section: str = ""  # the last top-level section without a timeout completed, how often, its longest
    done_count: int = 0
    done_longest_ns: int = 0

    @property
    def section_timeout(self) -> float | None:
        """The current section's timeout in seconds, or None (no section, or no timeout of its own)."""
        return self.section_timeout_ns / 1e9 if self.section and self.section_timeout_ns else None


def create(path: str | os.PathLike[str]) -> Path:
    """Create (or replace) an empty heartbeat file at `path` for one worker; called by the agent.

    The file is written beside its final name and renamed into place, so it gets a fresh inode:
    a worker of a previous round that still has the old file mapped keeps writing to the old,
    unlinked inode instead of hitting SIGBUS on a truncated mapping, and never disturbs the new one.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:  # whatever stands at the temporary name (a FIFO, a symlink) goes; O_EXCL makes a new file
        os.unlink(tmp)
    except FileNotFoundError:
        pass
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    with open(fd, "wb") as f:
        f.write(
            HEADER.pack(MAGIC)
            + BEAT.pack(0, 0, NO_STEP)
            + SECTION.pack(0, 0, 0, 0, b"")
            + bytes(LEARN_BEAT.size + LEARN_SECTION.size)
        )
    os.replace(tmp, path)
    return path


def read_record(path: str | os.PathLike[str]) -> HeartbeatRecord:
    """The whole record: last beat, its step, and the section the worker is in. Called by the agent.

    An ordinary read sees the worker's mapped writes because both go through the same page cache.
    The worker can replace the file (a FIFO, a symlink to /dev/zero): only a regular file is
    read, without blocking and never more than SIZE bytes (agent/base/untrusted_files.py).
    """
    try:
        data = read_capped(path, SIZE)
    except FileNotFoundError:
        raise HeartbeatFileError(f"heartbeat file {path} does not exist") from None
    except UntrustedFile as exc:
        raise HeartbeatFileError(str(exc)) from None
    _check(path, data)
    count, ns, step = BEAT.unpack_from(data, BEAT_OFFSET)
    changed, entered, timeout, _, raw_name = SECTION.unpack_from(data, SECTION_OFFSET)
    name = raw_name.rstrip(b"\0").decode("utf-8", errors="replace")
    intervals, longest = LEARN_BEAT.unpack_from(data, LEARN_BEAT_OFFSET)
    _, done_count, done_longest, _, done_name = LEARN_SECTION.unpack_from(data, LEARN_SECTION_OFFSET)
    return HeartbeatRecord(
        count, ns, None if step < 0 else step, name, entered, timeout, changed,
        intervals, longest, done_name.rstrip(b"\0").decode("utf-8", errors="replace"), done_count, done_longest,
    )  # fmt: skip


def read(path: str | os.PathLike[str]) -> tuple[int, int]:
    """Return `(count, monotonic_ns)` of the last beat; `(0, 0)` if the worker never beat."""
    record = read_record(path)
    return record.count, record.ns


def encode_section_name(name: str, limit: int = SECTION_NAME_BYTES) -> bytes:
    """The name as stored: UTF-8, cut to `limit` bytes on a character boundary."""
    data = name.encode("utf-8")
    if len(data) <= limit:
        return data
    return data[:limit].decode("utf-8", errors="ignore").encode("utf-8")


class HeartbeatWriter:
    """The worker's side: maps the file once, then each `beat` is one write to shared memory.

    Not thread-safe and not meant to be: one training loop beats. After a `fork` the child shares
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
                raise HeartbeatFileError(f"{self.path} is not a rally heartbeat file (shorter than {SIZE} bytes)")
            self._map = mmap.mmap(fd, SIZE, access=mmap.ACCESS_WRITE)
        finally:
            os.close(fd)  # the mapping keeps the file alive
        _check(self.path, self._map[:SIZE])
        # Continue the existing count so the agent's view stays monotonic if a writer is reopened.
        self._count: int = BEAT.unpack_from(self._map, BEAT_OFFSET)[0]
        self._intervals, self._longest = LEARN_BEAT.unpack_from(self._map, LEARN_BEAT_OFFSET)
        self._alive_ns = 0  # the later of the last beat and the last section change (0: no beat yet)
        self._sections_done = LEARN_SECTION.unpack_from(self._map, LEARN_SECTION_OFFSET)[0]
        self._section_stats: dict[str, tuple[int, int]] = {}  # name -> (completions, longest ns)

    def beat(self, step: int | None = None) -> None:
        """Record one beat: increment the count, store the current monotonic time and the step."""
        now = time.monotonic_ns()
        self._count += 1
        BEAT.pack_into(self._map, BEAT_OFFSET, self._count, now, NO_STEP if step is None else step)
        if self._alive_ns:
            self._intervals += 1
            self._longest = max(self._longest, now - self._alive_ns)
            LEARN_BEAT.pack_into(self._map, LEARN_BEAT_OFFSET, self._intervals, self._longest)
        self._alive_ns = now

    def set_section(self, name: str, entered_ns: int, timeout_ns: int) -> None:
        """Record that the worker is now in section `name` ("" = none), entered at `entered_ns`."""
        now = time.monotonic_ns()
        SECTION.pack_into(self._map, SECTION_OFFSET, now, entered_ns, timeout_ns, 0, encode_section_name(name))
        if self._alive_ns:
            self._alive_ns = now

    def section_done(self, name: str, entered_ns: int) -> None:
        """A top-level section without a timeout of its own ended: record its running longest.

        Each record carries that name's longest so far, so a read the agent misses (two sections
        ended between its reads) loses nothing that the name's next completion does not repeat."""
        count, longest = self._section_stats.get(name, (0, 0))
        count, longest = count + 1, max(longest, time.monotonic_ns() - entered_ns)
        self._section_stats[name] = (count, longest)
        self._sections_done += 1
        LEARN_SECTION.pack_into(
            self._map, LEARN_SECTION_OFFSET, self._sections_done, count, longest, 0, encode_section_name(name, 48)
        )

    def close(self) -> None:
        """Unmap the file; further beats raise `ValueError`."""
        self._map.close()


def _check(path: str | os.PathLike[str], data: bytes) -> None:
    """Refuse files that are not heartbeat files, so a wrong path fails loudly instead of scribbling."""
    if len(data) < SIZE or data[: HEADER.size] != MAGIC:
        raise HeartbeatFileError(f"{path} is not a rally heartbeat file (expected {SIZE} bytes starting {MAGIC!r})")
