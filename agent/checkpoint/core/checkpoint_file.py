"""The on-disk format of rally.job checkpoints: torch.save's bytes, then a footer that proves them whole.

Why a footer: whether `torch.load` manages to read a damaged file depends on where the damage
is (a flipped byte inside a tensor loads "fine"), on the torch version and on timing, so ranks
that each try to load the newest file could disagree on the step they resume from. A footer
written at save time gives one verdict for every reader, the agent's crash-loop check included:

    [ torch.save payload (N bytes) ][ footer: b"RALLYCK4" | N (u64) | step (u64) | job (16 B) | mac (32 B) | b"END4" ]

A file is intact and **authentic** only if it is a regular file, ends with that footer, is exactly
N + 76 bytes long and `mac`, an HMAC-SHA256 under the job's checkpoint key
(agent/checkpoint/core/auth.py) of the step, the writing job's tag and the digest of the N bytes
(agent/checkpoint/core/digest.py: SHA-256 leaves hashed on a few threads, then a root), verifies;
in a directory other users may write, the tag must be this job's (auth.other_job). Files of the
format before (`RALLYCK3 ... END3`, 60 bytes: no job) still load, with one line in such a directory.
One pass over the bytes; no CRC, since a MAC over every byte rejects any damage a CRC would.
Files written before authentication end in the 24-byte footer
`b"RALLYCKP" | N | crc32 | b"END1"` (no step, no MAC): intact when the CRC-32 matches, but
unauthenticated, and loaded only from a directory only the job's user can write (rally.job.load_latest says so).
Anything else (truncated, zero length, garbage, unreadable, a directory, FIFO or symlink under a
checkpoint's name, a file written by plain torch.save) is damaged and skipped. torch.load
ignores the bytes after its zip archive, so an intact file still loads with plain `torch.load(path)`.

Concurrent writers in one directory: each writer holds an exclusive `flock` on its temporary
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
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from rally.agent.checkpoint.core.digest import BytesLike, TreeDigest
from rally.agent.checkpoint.core.held_dir import shown
from rally.agent.checkpoint.core.shm import storage_bytes

FOOTER = struct.Struct("<8sQQ16s32s4s")
FOOTER_MAGIC, FOOTER_END = b"RALLYCK4", b"END4"
OLD_FOOTER = struct.Struct("<8sQQ32s4s")
"""The footer before checkpoints were bound to their job: signed, any job of the user's."""
OLD_MAGIC, OLD_END = b"RALLYCK3", b"END3"
LEGACY_FOOTER = struct.Struct("<8sQI4s")
"""The footer before checkpoints were signed: intact, never authentic."""
LEGACY_MAGIC, LEGACY_END = b"RALLYCKP", b"END1"
MAC_KIND = "whole"
READ_CHUNK = 8 << 20
"""Bytes the persister copies at a time (8 MiB: large writes, bounded memory; one digest leaf)."""

TEMP_RE = re.compile(r"^\.step_\d+\.pt\..*\.tmp$")
_VERDICT_CACHE_LIMIT = 256


class DamagedCheckpoint(Exception):
    """A checkpoint file that fails verification; the message says why, in a few words."""


@dataclass(frozen=True)
class Checkpoint:
    """A checkpoint that `rally.job.load_latest` found.

    Defined here, not in job.py, so that the sharded storage (which job.py imports when asked) need
    not import job.py.

    Attributes:
        step: The step it was saved at.
        state: What was saved.
        path: Its file on disk, where it is or will be durable.
        source: "memory" when mapped from the node's shared memory, "disk" when read from `path`.
    """

    step: int
    state: Any
    path: Path
    source: str = "disk"  # "memory": mapped from the node's shared memory; "disk": from `path`


@dataclass(frozen=True)
class Verified:
    """What a check of a file found: `signed` by this job's key (False: a legacy, unauthenticated
    file), the step its footer signs (None for a legacy file), and the tag of the job that signed
    it (None: a legacy file, or one signed before checkpoints were bound to their job)."""

    signed: bool
    step: int | None
    job: bytes | None = None


class Sums:
    """The digest of a payload (agent/checkpoint/core/digest.py), fed in pieces; `footer` signs it.

    `borrowed` pieces (a mapping the caller keeps until `footer`) are still hashing on the
    digest's threads when `update` returns: the persister writes the next piece meanwhile."""

    def __init__(self, step: int) -> None:
        from rally.agent.checkpoint.core import auth, digest

        self.step, self.key, self.job = step, auth.signing_key(), auth.job_tag()
        self.tree = digest.TreeDigest()

    @property
    def length(self) -> int:
        return self.tree.length

    def update(self, view: BytesLike, *, borrowed: bool = False) -> None:
        self.tree.update(view, borrowed=borrowed)

    def footer(self) -> bytes:
        from rally.agent.checkpoint.core import auth

        mac = auth.seal(self.key, MAC_KIND, self.step, self.tree.root(), self.job)
        return FOOTER.pack(FOOTER_MAGIC, self.length, self.step, self.job, mac, FOOTER_END)


class _ChecksumWriter:
    """A write-only file wrapper that feeds the bytes torch.save writes to a `Sums`."""

    def __init__(self, file: BinaryIO, sums: Sums) -> None:
        self.file = file
        self.sums = sums

    def write(self, data: BytesLike) -> int:
        view = memoryview(data)
        self.sums.update(view)
        return self.file.write(view)

    def flush(self) -> None:
        self.file.flush()


def write(state: Any, final: Path, step: int) -> None:
    """Write `state` durably to `final` (atomic rename), signed as `step`; a crash leaves `final` as it was."""
    import torch

    directory = final.parent
    sums = Sums(step)
    fd, tmp = locked_temp(final)
    try:
        with os.fdopen(fd, "wb", closefd=False) as f:
            torch.save(state, _ChecksumWriter(f, sums))  # type: ignore[arg-type]  # any object with write()
            f.write(sums.footer())
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
    """A new temporary file next to `final`, created and locked by this process.

    Between creation and the lock a cleaner may take the lock and delete the file; that is
    seen (the name no longer points at our file) and another one is made.
    """
    while True:
        fd, tmp = tempfile.mkstemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent)
        if not lock_file(fd, blocking=True):
            return fd, tmp  # no locks on this file system: cleaners delete nothing either
        try:
            if os.stat(tmp).st_ino == os.fstat(fd).st_ino:
                return fd, tmp
        except FileNotFoundError:
            pass
        os.close(fd)


def lock_file(fd: int, *, blocking: bool) -> bool:
    """Take an exclusive flock; False when it is held by another process or unsupported."""
    try:
        # wait: short: blocking only on a temp file whose writer holds it for one write
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
            fd = os.open(path, os.O_RDWR | os.O_NONBLOCK | os.O_NOFOLLOW)  # writable: NFS locks need it
        except OSError:
            continue  # renamed or deleted meanwhile, or not ours to touch
        try:
            if lock_file(fd, blocking=False) and os.stat(path).st_ino == os.fstat(fd).st_ino:
                os.unlink(path)
        except OSError:
            pass
        finally:
            os.close(fd)


def _open_for_check(path: Path) -> int:
    """A read-only fd of `path` that never blocks (a FIFO in its place); FileNotFoundError as
    is, any other failure to open is damage."""
    try:
        return os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)  # no FIFO blocks, no link
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise DamagedCheckpoint(f"cannot open it: {exc.strerror}") from None


def open_verified(path: Path) -> BinaryIO:
    """Open `path` and check it end to end (a legacy file passes as intact); return it positioned
    at 0, or raise DamagedCheckpoint. For tests and tools: loaders use `open_mapped_verified`."""
    fd, _ = open_mapped_verified(path)
    return os.fdopen(fd, "rb")


def open_mapped_verified(path: Path) -> tuple[int, Verified]:
    """Open `path` (never through a link), check it end to end through a read-only mapping;
    return the open fd and what the check found (signed by this job, or a legacy file).

    One pass over the bytes (the digest, on its threads; a legacy file's CRC), and they stay in the page cache for
    the reader that maps the same fd (`torch.load("/proc/self/fd/<fd>", mmap=True)`): a load
    reads the file once, and what it loads is what was checked. A file whose MAC does not verify
    is DamagedCheckpoint ("not signed with this job's key"). The caller closes the fd.
    """
    fd = _open_for_check(path)
    try:
        return fd, _verify_mapped(fd)
    except BaseException:
        os.close(fd)
        raise


def _verify_mapped(fd: int) -> Verified:
    from rally.agent.checkpoint.core import auth, digest

    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        raise DamagedCheckpoint("not a regular file")
    size = info.st_size
    if size == 0:
        raise DamagedCheckpoint("empty file")
    if size < LEGACY_FOOTER.size:
        raise DamagedCheckpoint(f"only {size} bytes, no rally footer")
    try:
        with mmap.mmap(fd, size, prot=mmap.PROT_READ) as data:
            tail = data[size - 4 : size]
            signed = (size >= FOOTER.size and tail == FOOTER_END) or (size >= OLD_FOOTER.size and tail == OLD_END)
            job: bytes | None = None
            if signed and tail == FOOTER_END:
                magic, length, step, job, mac, end = FOOTER.unpack_from(data, size - FOOTER.size)
                footer_size, crc = FOOTER.size, None
            elif signed:
                magic, length, step, mac, end = OLD_FOOTER.unpack_from(data, size - OLD_FOOTER.size)
                footer_size, crc = OLD_FOOTER.size, None
            else:
                magic, length, crc, end = LEGACY_FOOTER.unpack_from(data, size - LEGACY_FOOTER.size)
                footer_size, step, mac = LEGACY_FOOTER.size, None, b""
            known = ((FOOTER_MAGIC, FOOTER_END), (OLD_MAGIC, OLD_END), (LEGACY_MAGIC, LEGACY_END))
            if (magic, end) not in known:
                raise DamagedCheckpoint("no rally footer: truncated, or not written by rally.job.save")
            if length != size - footer_size:
                raise DamagedCheckpoint(f"length {size - footer_size} bytes, the footer says {length}")
            with memoryview(data) as view, view[:length] as payload:
                if signed:
                    keys = auth.keys()  # NoKey before any hashing
                    root = digest.of(payload)  # every leaf done: nothing holds the mapping after this
                else:
                    actual = zlib.crc32(payload)
    except (OSError, ValueError) as exc:
        raise DamagedCheckpoint(f"read error: {getattr(exc, 'strerror', None) or exc}") from None
    except auth.NoKey as exc:
        raise DamagedCheckpoint(str(exc)) from None
    if signed:
        if not any(auth.sealed(key, MAC_KIND, step, root, mac, job) for key in keys):
            raise DamagedCheckpoint(
                "not signed with this job's checkpoint key (damaged, or written by another user or under "
                "another job token)"
            )
    elif actual != crc:
        raise DamagedCheckpoint(f"checksum mismatch: crc32 {actual:08x}, the footer says {crc:08x}")
    return Verified(signed, step, job)


def is_complete(path: Path) -> bool:
    """Whether `path` is a regular file ending in a footer whose length matches: written to the
    end and renamed into place. Cheap (no digest); the MAC is checked when it is loaded."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
    except OSError:
        return False
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size < LEGACY_FOOTER.size:
            return False
        if info.st_size >= FOOTER.size:
            magic, length, _, _, _, end = FOOTER.unpack(os.pread(fd, FOOTER.size, info.st_size - FOOTER.size))
            if (magic, end) == (FOOTER_MAGIC, FOOTER_END):
                return length == info.st_size - FOOTER.size
        if info.st_size >= OLD_FOOTER.size:
            magic, length, _, _, end = OLD_FOOTER.unpack(os.pread(fd, OLD_FOOTER.size, info.st_size - OLD_FOOTER.size))
            if (magic, end) == (OLD_MAGIC, OLD_END):
                return length == info.st_size - OLD_FOOTER.size
        magic, length, _, end = LEGACY_FOOTER.unpack(
            os.pread(fd, LEGACY_FOOTER.size, info.st_size - LEGACY_FOOTER.size)
        )
        return magic == LEGACY_MAGIC and end == LEGACY_END and length == info.st_size - LEGACY_FOOTER.size
    except (OSError, struct.error):
        return False
    finally:
        os.close(fd)


_verdicts: dict[tuple[str, int, int, int, int, int], bool] = {}


def is_intact(path: Path) -> bool:
    """Whether `path` passes `open_verified`, remembered per file version.

    The agent asks at every rendezvous round; a checkpoint never changes after its rename (a
    rewrite is a new inode or a new ctime), so each version is read once.
    """
    try:
        info = os.lstat(path)
    except OSError:
        return False
    key = (str(path), info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns)
    if key not in _verdicts:
        try:
            fd, verified = open_mapped_verified(path)
            os.close(fd)
            refused = refusal(path, verified)
            if refused is not None:
                from rally.agent.checkpoint.core import auth

                auth.note_refusal(path, refused)
            verdict = refused is None
        except (DamagedCheckpoint, FileNotFoundError):
            verdict = False
        if len(_verdicts) >= _VERDICT_CACHE_LIMIT:
            _verdicts.clear()
        _verdicts[key] = verdict
    return _verdicts[key]


_NAME_STEP = re.compile(r"^step_(\d+)\.pt$")


def refusal(path: Path, verified: Verified) -> str | None:
    """Why an intact `path` must not be loaded (one clause), or None. A signed file must sign
    the step its name says (a genuine older file renamed to a newer step is refused); a legacy
    (unsigned) file loads only from a directory only this user can write."""
    from rally.agent.checkpoint.core import auth

    if verified.signed:
        named = _NAME_STEP.match(path.name)
        if named and int(named.group(1)) != verified.step:
            return f"signed for step {verified.step}, not for the step its name says (renamed)"
        return auth.other_job(verified.job, path.parent)
    problem = auth.directory_problem(path.parent)
    if problem is None:
        return None
    return f"written before checkpoints were signed, and {path.parent} {problem}: an unauthenticated file is not loaded"


def old_format_line(path: Path, verified: Verified) -> str | None:
    """One line when a signed file of the format before job binding is loaded from a directory
    others may write (where the binding matters); None otherwise."""
    from rally.agent.checkpoint.core import auth

    if not verified.signed or verified.job is not None or auth.directory_problem(path.parent) is None:
        return None
    return auth.old_format_line(path)


def unauthenticated_line(path: Path) -> str:
    return (
        f"checkpoint {shown(path)} was written before rally signed checkpoints: it is unauthenticated, loaded "
        "because only you can write its directory"
    )


def write_digested(
    fd: int, view: memoryview, tree: TreeDigest, chunk: int, before_chunk: Callable[[], None] | None = None
) -> None:
    """Write all of `view` (a slot's mapping, or bytes its caller keeps) to `fd` in `chunk`-byte
    pieces, each hashed into `tree` on the digest's threads while the next one is written: the
    copy to disk of both persisters, a whole state's (agent/checkpoint/persist.py) and a rank's
    sharded files (agent/checkpoint/sharded/persist.py). `before_chunk` runs before each piece (it
    may wait while a save copies, or raise to give the write up). Every leaf is hashed when this
    returns or raises: the caller may close the mapping, and `tree.root()` is ready."""
    done = 0
    try:
        while done < view.nbytes:
            if before_chunk is not None:
                before_chunk()
            with view[done : done + chunk] as piece:
                n = os.write(fd, piece)
                tree.update(piece[:n], borrowed=True)  # `view` outlives the hashing: settled below
            done += n
    finally:
        tree.settle()


def prune_older(steps: list[tuple[int, Path]], keep: int, own_step: int, remove: Callable[[Path], None]) -> None:
    """Keep-K pruning, one rule for whole-state files and sharded directories: of `steps` (a
    directory's checkpoints, oldest first), keep `own_step` (just written) and the `keep - 1`
    newest older ones; `remove` the rest (one already gone is no error).

    Newer checkpoints are not this save's to judge: they belong to a concurrent saver that is
    further along (whose own save prunes relative to its step), or they are damaged ones this job
    resumed past, which the save of their step replaces."""
    older = [path for step, path in steps if step < own_step]
    for path in older[: max(0, len(older) - (keep - 1))]:
        with contextlib.suppress(FileNotFoundError):
            remove(path)


def fsync_dir(directory: Path) -> None:
    """Make the rename durable: without this a power loss may forget the new directory entry."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
