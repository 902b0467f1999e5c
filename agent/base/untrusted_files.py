"""Reading files that a worker (or a user) can touch, without letting them steer the reader.

A worker can replace any file in its rank directory: its heartbeat file, its error file
(TORCHELASTIC_ERROR_FILE), its redirected logs. A plain `open()` + `read()` of such a file lets
it wedge the agent: a FIFO blocks the open for ever (and the agent ignores SIGTERM while stuck
in it), a symlink to /dev/zero is read until memory runs out, and JSON nested 100 000 deep
raises RecursionError. So every such read here opens with O_NOFOLLOW | O_NONBLOCK (never
follows a last-component symlink, never blocks on a FIFO or a device), checks with fstat that
it got a regular file, and reads at most a given number of bytes. JSON read this way must be an
object; the caller checks the fields it uses. Standard library only: the launcher uses it too
(a --config that names a FIFO).
"""

from __future__ import annotations

import errno
import json
import os
import stat
from typing import Any, BinaryIO

# The flags of every open here: no symlink at the last component, no blocking open (FIFO, tty).
OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


class UntrustedFile(OSError):
    """The path is not a regular file, is a symlink, or is larger than the reader accepts."""


def open_regular(path: str | os.PathLike[str], follow: bool = False) -> int:
    """A read-only fd of `path`, which must be a regular file that is not a symlink (with
    `follow`, a symlink to a regular file is fine: for files the user names, not a worker)."""
    try:
        fd = os.open(path, OPEN_FLAGS & ~os.O_NOFOLLOW if follow else OPEN_FLAGS)
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # the last component is a symlink (O_NOFOLLOW)
            raise UntrustedFile(f"{path} is a symbolic link") from None
        raise
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise UntrustedFile(f"{path} is not a regular file ({_kind(mode)})")
        os.set_blocking(fd, True)  # a regular file never blocks; reads then behave plainly
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_capped(
    path: str | os.PathLike[str], limit: int, *, tail: bool = False, whole: bool = False, follow: bool = False
) -> bytes:
    """At most `limit` bytes of the regular file `path`: its start, or with `tail` its end.
    With `whole`, a file larger than `limit` is an UntrustedFile (a truncated JSON is no use)."""
    fd = open_regular(path, follow)
    try:
        size = os.fstat(fd).st_size
        if size > limit and whole:
            raise UntrustedFile(f"{path} holds {size} bytes, more than the {limit} read here")
        offset = max(0, size - limit) if tail else 0
        chunks, left = [], limit
        while left > 0:  # the file may grow while read: never past `limit`
            chunk = os.pread(fd, min(left, 1 << 20), offset)
            if not chunk:
                break
            chunks.append(chunk)
            offset += len(chunk)
            left -= len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def open_for_writing(path: str | os.PathLike[str]) -> BinaryIO:
    """`open(path, "wb")` that a worker cannot wedge or redirect: a FIFO at `path` (its open for
    writing blocks until a reader comes) or a symlink (truncating whatever it points to) is
    removed and a fresh file made in its place. A device (/dev/null, named by a LogsSpecs) is
    written as it is."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    for _ in range(3):
        try:
            fd = os.open(path, flags | os.O_TRUNC, 0o600)  # logs and reports hold stderr tails
        except OSError as exc:  # ELOOP: a symlink; ENXIO: a FIFO without a reader; EEXIST: a race
            if exc.errno not in (errno.ELOOP, errno.ENXIO, errno.EEXIST):
                raise
            _unlink(path)
            flags |= os.O_EXCL
            continue
        if not stat.S_ISFIFO(os.fstat(fd).st_mode):
            os.set_blocking(fd, True)
            return open(fd, "wb")  # the caller owns it
        os.close(fd)  # a FIFO that has a reader
        _unlink(path)
        flags |= os.O_EXCL
    raise UntrustedFile(f"{path} keeps being replaced by a FIFO or a symlink")


def _unlink(path: str | os.PathLike[str]) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def read_json_object(path: str | os.PathLike[str], limit: int) -> dict[str, Any]:
    """The JSON object in `path` (at most `limit` bytes). Raises UntrustedFile for anything
    else: not a regular file, too large, not JSON, nested too deep, or not an object."""
    data = read_capped(path, limit, whole=True)
    try:
        value = json.loads(data)
    except (ValueError, RecursionError) as exc:  # RecursionError: "[[[[..." 100 000 deep
        raise UntrustedFile(f"{path} is not valid JSON ({type(exc).__name__})") from None
    if not isinstance(value, dict):
        raise UntrustedFile(f"{path} holds a JSON {type(value).__name__}, not an object")
    return value


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISDIR, "a directory"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket")):  # fmt: skip
        if test(mode):
            return name
    return "not a regular file"
