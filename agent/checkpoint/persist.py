"""Make one in-memory copy durable: the holder's persister copies a slot into --checkpoint-dir.

The file it writes is exactly what `job.save` writes (agent/checkpoint/core/checkpoint_file.py): the torch.save
archive, then rally's footer with its length, step and MAC (agent/checkpoint/core/auth.py). The digest
the MAC signs (agent/checkpoint/core/digest.py) is computed while the bytes are copied, each 8 MiB
leaf on one of the digest's threads while the next is written, so a durable checkpoint costs one
read of memory and one write of the disk (the hashing runs in the background of training, never
in the training step's stall). Atomic as ever: a
locked temporary file in the same directory, fsync, rename over `step_<step:012d>.pt`, fsync
the directory, then keep-K pruning exactly as `job.save` prunes.

A full disk is a `DiskFull` whose message is one line naming the directory, the step,
the bytes needed and the bytes free; the temporary file is removed, nothing else is touched
(the in-memory copy and the previous durable checkpoint stay).
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import re
from collections.abc import Callable
from pathlib import Path

from rally.agent.checkpoint import checkpoint_dir
from rally.agent.checkpoint.core import auth, checkpoint_file
from rally.agent.checkpoint.core.checkpoint_file import FOOTER, READ_CHUNK, Sums
from rally.agent.checkpoint.core.held_dir import shown


class DiskFull(OSError):
    """No room in the checkpoint directory for a step; the message is the one line to print."""


class PersistCancelled(Exception):
    """The persist was given up (the holder is shutting down); its temporary file is gone."""


_NAME_RE = re.compile(r"^(?!.*\.\.)[A-Za-z0-9_.-]+(/[A-Za-z0-9_.-]+)*$")


def default_name(step: int) -> str:
    """The file `job.save` writes for `step`; the only name keep-K pruning applies to."""
    return f"step_{step:012d}.pt"


def valid_name(name: str) -> bool:
    """A relative path inside the checkpoint directory (no `..`, no leading `/`)."""
    return bool(_NAME_RE.match(name)) and len(name) <= 255


def persist(
    source: int, length: int, directory: Path, step: int, keep: int,
    between_chunks: Callable[[], bool] = lambda: False, name: str | None = None,
) -> Path:  # fmt: skip
    """Copy the first `length` bytes of the memfd `source` (a slot) to `directory/name` (by
    default `step_<step>.pt`, pruned to the newest `keep`; other names are not pruned).

    `between_chunks` is called before each chunk (8 MiB); it may wait (the holder pauses the
    copy to disk while a worker copies into a slot) and returns True to give the persist up.
    """
    final = directory / (name or default_name(step))
    auth.make_private_dir(directory)
    level = directory
    for part in final.parent.relative_to(directory).parts:  # a name of its own, e.g. a rank's shard
        level = level / part
        auth.private_subdir(level)  # 0700, ours, never a link
    checkpoint_file.remove_dead_writers_temps(final.parent)
    directory = final.parent
    needed = length + FOOTER.size
    free = _free_bytes(directory)
    if free is not None and free < needed:
        raise DiskFull(_full_line(directory, step, needed, free))
    fd, tmp = checkpoint_file.locked_temp(final)
    try:
        sums = Sums(step)
        if length:

            def before_chunk() -> None:
                if between_chunks():
                    raise PersistCancelled()

            with mmap.mmap(source, length, prot=mmap.PROT_READ) as data, memoryview(data) as view:
                checkpoint_file.write_digested(fd, view, sums.tree, READ_CHUNK, before_chunk)
        _write_all(fd, sums.footer())
        os.fsync(fd)
        os.replace(tmp, final)
    except OSError as exc:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise DiskFull(_full_line(directory, step, needed, _free_bytes(directory) or 0)) from None
        raise
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    finally:
        os.close(fd)  # releases the temp file's lock after the rename, as job.save does
    checkpoint_file.fsync_dir(directory)
    if final.name == default_name(step):
        checkpoint_dir.prune(directory, keep, protect=final)
    return final


def _write_all(fd: int, data: memoryview | bytes) -> None:
    done, total = 0, len(data) if isinstance(data, bytes) else data.nbytes
    while done < total:
        with memoryview(data)[done:] as rest:
            done += os.write(fd, rest)


def _free_bytes(directory: Path) -> int | None:
    try:
        info = os.statvfs(directory)
    except OSError:
        return None
    return info.f_bavail * info.f_frsize


def _full_line(directory: Path, step: int, needed: int, free: int) -> str:
    return (
        f"checkpoint step {step} could not be written to {shown(directory)}: the disk is full "
        f"({_mb(needed)} needed, {_mb(free)} free); the in-memory copy and the previous "
        "checkpoint on disk are kept: free space there or point --checkpoint-dir elsewhere"
    )


def _mb(size: int) -> str:
    return f"{size / 1e6:.1f} MB"
