"""The on-disk format of rally.job checkpoints: torch.save's bytes, then a footer that proves them whole.

Why a footer: whether ``torch.load`` manages to read a damaged file depends on where the damage
is (a flipped byte inside a tensor loads "fine"), on the torch version and on timing, so ranks
that each try to load the newest file could disagree on the step they resume from. A footer
written at save time gives one verdict for every reader, the agent's crash-loop check included::

    [ torch.save payload (N bytes) ][ footer: b"RALLYCKP" | N (u64 LE) | crc32 (u32 LE) | b"END1" ]

A file is intact only if it is a regular file, ends with that footer, is exactly N + 24 bytes
long and its first N bytes have that CRC-32. Anything else (truncated, zero length, garbage,
unreadable, a directory or FIFO under a checkpoint's name, a file written by plain torch.save)
is damaged and skipped. torch.load ignores the bytes after its zip archive, so an intact file
still loads with plain ``torch.load(path)``.

Concurrent writers in one directory: each writer holds an exclusive ``flock`` on its temporary
file from creation until the rename, and a temporary file is deleted only by whoever can take
that lock, i.e. only when its writer is dead. Where the file system has no locks, nothing is
deleted (safe, at the cost of leftovers).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import mmap
import os
import re
import stat
import struct
import tempfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from rally.agent.checkpoint.shm import storage_bytes

FOOTER = struct.Struct("<8sQI4s")
FOOTER_MAGIC, FOOTER_END = b"RALLYCKP", b"END1"
READ_CHUNK = 8 << 20
"""Bytes read at a time while checking a file's CRC (8 MiB: large reads, bounded memory)."""

TEMP_RE = re.compile(r"^\.step_\d+\.pt\..*\.tmp$")
_VERDICT_CACHE_LIMIT = 256


class DamagedCheckpoint(Exception):
    """A checkpoint file that fails verification; the message says why, in a few words."""


@dataclass(frozen=True)
class Checkpoint:
    """A checkpoint found by ``rally.job.load_latest``: the step it was saved at, its state, its
    file on disk (where it is or will be durable) and where it was read from. Defined here, not in
    job.py, so that dcp_storage (which job.py imports when asked) need not import job.py."""

    step: int
    state: Any
    path: Path
    source: str = "disk"  # "memory": mapped from the node's shared memory; "disk": from ``path``


class _ChecksumWriter:
    """A write-only file wrapper that counts the bytes torch.save writes and their CRC-32."""

    def __init__(self, file: BinaryIO) -> None:
        self.file = file
        self.crc = 0
        self.length = 0

    def write(self, data: Any) -> int:
        view = memoryview(data)
        self.crc = zlib.crc32(view, self.crc)
        self.length += view.nbytes
        return self.file.write(view)

    def flush(self) -> None:
        self.file.flush()


def write(state: Any, final: Path) -> None:
    """Write ``state`` durably to ``final`` (atomic rename); a crash leaves ``final`` as it was."""
    import torch

    directory = final.parent
    fd, tmp = locked_temp(final)
    try:
        with os.fdopen(fd, "wb", closefd=False) as f:
            writer = _ChecksumWriter(f)
            torch.save(state, writer)  # type: ignore[arg-type]  # any object with write() (torch's FileLike says IO)
            f.write(FOOTER.pack(FOOTER_MAGIC, writer.length, writer.crc, FOOTER_END))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
    except BaseException as exc:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        if _disk_full(exc):  # torch reports it as "unexpected pos ..." with ENOSPC deep in the chain
            raise OSError(errno.ENOSPC, _disk_full_line(final, storage_bytes(state))) from None
        raise
    finally:
        os.close(fd)  # releases the lock, after the rename: a cleaner never sees it unlocked
    fsync_dir(directory)


def _disk_full(exc: BaseException | None) -> bool:
    seen = 0
    while exc is not None and seen < 10:
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return False


def _disk_full_line(final: Path, needed: int) -> str:
    """One line: the file, its directory, the bytes it needs (its tensors, at least) and the free ones."""
    try:
        info = os.statvfs(final.parent)
        free = f"{info.f_bavail * info.f_frsize / 1e6:.1f} MB free"
    except OSError:
        free = "free space unknown"
    return (
        f"checkpoint {final.name} could not be written to {final.parent}: the disk is full (No space left "
        f"on device; at least {needed / 1e6:.1f} MB needed, {free}); the previous checkpoints are kept"
    )


def locked_temp(final: Path) -> tuple[int, str]:
    """A new temporary file next to ``final``, created and locked by this process.

    Between creation and the lock a cleaner may take the lock and delete the file; that is
    seen (the name no longer points at our file) and another one is made.
    """
    while True:
        fd, tmp = tempfile.mkstemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent)
        if not _lock(fd, blocking=True):
            return fd, tmp  # no locks on this file system: cleaners delete nothing either
        try:
            if os.stat(tmp).st_ino == os.fstat(fd).st_ino:
                return fd, tmp
        except FileNotFoundError:
            pass
        os.close(fd)


def _lock(fd: int, *, blocking: bool) -> bool:
    """Take an exclusive flock; False when it is held by another process or unsupported."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
        return True
    except OSError as exc:
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL, errno.EBADF):
            return False
        raise


def remove_dead_writers_temps(directory: Path) -> None:
    """Delete temporary files whose writer died (nobody holds their lock); never a live writer's."""
    for name in os.listdir(directory):
        if not TEMP_RE.match(name):
            continue
        path = directory / name
        try:
            fd = os.open(path, os.O_RDWR | os.O_NONBLOCK)  # writable: NFS locks need it
        except OSError:
            continue  # renamed or deleted meanwhile, or not ours to touch
        try:
            if _lock(fd, blocking=False) and os.stat(path).st_ino == os.fstat(fd).st_ino:
                os.unlink(path)
        except OSError:
            pass
        finally:
            os.close(fd)


def _open_for_check(path: Path) -> int:
    """A read-only fd of ``path`` that never blocks (a FIFO in its place); FileNotFoundError as
    is, any other failure to open is damage."""
    try:
        return os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # O_NONBLOCK: a FIFO must not block us
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise DamagedCheckpoint(f"cannot open it: {exc.strerror}") from None


def open_verified(path: Path) -> BinaryIO:
    """Open ``path`` and check it end to end; return it positioned at 0, or raise DamagedCheckpoint."""
    fd = _open_for_check(path)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise DamagedCheckpoint("not a regular file")
        file = os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise
    try:
        _verify(file)
        file.seek(0)
        return file
    except BaseException:
        file.close()
        raise


def _verify(file: BinaryIO) -> None:
    size = os.fstat(file.fileno()).st_size
    if size == 0:
        raise DamagedCheckpoint("empty file")
    if size < FOOTER.size:
        raise DamagedCheckpoint(f"only {size} bytes, no rally footer")
    try:
        file.seek(size - FOOTER.size)
        magic, length, crc, end = FOOTER.unpack(file.read(FOOTER.size))
        if magic != FOOTER_MAGIC or end != FOOTER_END:
            raise DamagedCheckpoint("no rally footer: truncated, or not written by rally.job.save")
        if length != size - FOOTER.size:
            raise DamagedCheckpoint(f"length {size - FOOTER.size} bytes, the footer says {length}")
        file.seek(0)
        actual = crc32_of(file, length, "shorter than its footer says")
    except OSError as exc:
        raise DamagedCheckpoint(f"read error: {exc.strerror}") from None
    if actual != crc:
        raise DamagedCheckpoint(f"checksum mismatch: crc32 {actual:08x}, the footer says {crc:08x}")


def crc32_of(file: BinaryIO, length: int, short: str) -> int:
    """The CRC-32 of the next ``length`` bytes of ``file``, read in chunks; DamagedCheckpoint(``short``)
    if it ends first. One reading loop for every verifier (here and agent/checkpoint/dcp_files.py)."""
    actual, remaining = 0, length
    while remaining:
        chunk = file.read(min(READ_CHUNK, remaining))
        if not chunk:
            raise DamagedCheckpoint(short)
        actual = zlib.crc32(chunk, actual)
        remaining -= len(chunk)
    return actual


def open_mapped_verified(path: Path) -> int:
    """Open ``path``, check it end to end through a read-only mapping; return the open fd.

    One pass over the bytes (the CRC), and they stay in the page cache for the reader that maps
    the same fd (``torch.load("/proc/self/fd/<fd>", mmap=True)``): a load reads the file once,
    not once for the check and again for torch. The caller closes the fd.
    """
    fd = _open_for_check(path)
    try:
        _verify_mapped(fd)
        return fd
    except BaseException:
        os.close(fd)
        raise


def _verify_mapped(fd: int) -> None:
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        raise DamagedCheckpoint("not a regular file")
    size = info.st_size
    if size == 0:
        raise DamagedCheckpoint("empty file")
    if size < FOOTER.size:
        raise DamagedCheckpoint(f"only {size} bytes, no rally footer")
    try:
        with mmap.mmap(fd, size, prot=mmap.PROT_READ) as data:
            magic, length, crc, end = FOOTER.unpack_from(data, size - FOOTER.size)
            if magic != FOOTER_MAGIC or end != FOOTER_END:
                raise DamagedCheckpoint("no rally footer: truncated, or not written by rally.job.save")
            if length != size - FOOTER.size:
                raise DamagedCheckpoint(f"length {size - FOOTER.size} bytes, the footer says {length}")
            with memoryview(data) as view:
                actual = 0
                for start in range(0, length, READ_CHUNK):
                    actual = zlib.crc32(view[start : min(start + READ_CHUNK, length)], actual)
    except (OSError, ValueError) as exc:
        raise DamagedCheckpoint(f"read error: {getattr(exc, 'strerror', None) or exc}") from None
    if actual != crc:
        raise DamagedCheckpoint(f"checksum mismatch: crc32 {actual:08x}, the footer says {crc:08x}")


def is_complete(path: Path) -> bool:
    """Whether ``path`` is a regular file ending in a footer whose length matches: written to the
    end and renamed into place. Cheap (no CRC); the CRC is checked when it is loaded."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return False
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size < FOOTER.size:
            return False
        magic, length, _, end = FOOTER.unpack(os.pread(fd, FOOTER.size, info.st_size - FOOTER.size))
        return magic == FOOTER_MAGIC and end == FOOTER_END and length == info.st_size - FOOTER.size
    except (OSError, struct.error):
        return False
    finally:
        os.close(fd)


_verdicts: dict[tuple[str, int, int, int, int, int], bool] = {}


def is_intact(path: Path) -> bool:
    """Whether ``path`` passes :func:`open_verified`, remembered per file version.

    The agent asks at every rendezvous round; a checkpoint never changes after its rename (a
    rewrite is a new inode or a new ctime), so each version is read once.
    """
    try:
        info = os.stat(path)
    except OSError:
        return False
    key = (str(path), info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns)
    if key not in _verdicts:
        try:
            open_verified(path).close()
            verdict = True
        except (DamagedCheckpoint, FileNotFoundError):
            verdict = False
        if len(_verdicts) >= _VERDICT_CACHE_LIMIT:
            _verdicts.clear()
        _verdicts[key] = verdict
    return _verdicts[key]


def fsync_dir(directory: Path) -> None:
    """Make the rename durable: without this a power loss may forget the new directory entry."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
