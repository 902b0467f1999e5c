"""Which paths rally may write through or read a secret from: ssh's StrictModes rule, in one place.

Why: rally runs jobs as root and as users on machines other users share. A directory on the
way to where rally writes (--log-dir, the run directory, --checkpoint-dir, the run index) or
reads a secret (token_file, password_file, ~/.rally) that another user can change lets that
user rename rally's directory away and put their own in its place, with a link where rally
will write: root then truncates a file of the attacker's choosing, or a job resumes from
nothing. As ssh does for a key's path, every directory the path passes through, from `/` down,
and every symbolic link on the way must be owned by this user or root, and none may be writable
by everyone without the sticky bit (/tmp has it: nobody can rename another's entry there). A
directory its group may write (a team's project directory, common and legitimate) is allowed
with one warning line naming it.

The walk opens each directory with O_PATH | O_DIRECTORY | O_NOFOLLOW relative to the one above
it and judges what it opened (fstat), so the directory judged is the one used: `open_directory`
returns a descriptor of the last one, and whoever writes relative to it (dir_fd=) writes there
whatever is renamed or linked in its path afterwards.

Standard library only: the launcher, the agent and rendezvous/base/token.py use it.
"""

from __future__ import annotations

import collections
import errno
import grp
import os
import stat
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

_WALK_FLAGS = os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_MAX_LINKS = 40  # as the kernel's own limit on links followed in one lookup (ELOOP)


class UnsafePath(Exception):
    """A path another user could change; the message is one line that says which part and how to fix it."""


@dataclass
class Walk:
    """What `open_directory` found: a descriptor of the directory (None when it does not exist
    and was not to be made), its real path, and one warning line per group-writable directory."""

    fd: int | None
    real: Path
    warnings: list[str] = field(default_factory=list)

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def trusted_owner(uid: int) -> bool:
    """This user or root: the only owners of anything rally writes through or reads a secret from."""
    return uid in (0, os.geteuid())


def _own_group(gid: int) -> bool:
    """root's group, or this user's own private group (umask 002 systems make every home 0775)."""
    if gid == 0:
        return True
    if gid != os.getegid():
        return False
    try:
        return not grp.getgrgid(gid).gr_mem
    except KeyError:
        return False


def _refuse(what: str, path: Path, problem: str) -> UnsafePath:
    return UnsafePath(
        f"{what}: {path} {problem}, so another user could swap what rally writes or reads there; "
        "use a path whose directories only you (or root) can change"
    )


def judge_directory(info: os.stat_result, path: Path, what: str, warnings: list[str]) -> None:
    """Raise UnsafePath for a directory another user owns or everyone may write (no sticky bit);
    one warning line in `warnings` for one its group may write."""
    if not trusted_owner(info.st_uid):
        raise _refuse(what, path, f"is owned by uid {info.st_uid}, not by you (uid {os.geteuid()}) or root")
    sticky = info.st_mode & stat.S_ISVTX
    mode = stat.S_IMODE(info.st_mode)
    if info.st_mode & stat.S_IWOTH and not sticky:
        raise _refuse(what, path, f"can be written by every user (mode {mode:04o}, no sticky bit)")
    if info.st_mode & stat.S_IWGRP and not sticky and not _own_group(info.st_gid):
        warnings.append(
            f"{what}: {path} can be written by its group (gid {info.st_gid}, mode {mode:04o}): a member could "
            "rename what rally makes there; rally writes through the directories it opened, but chmod g-w it "
            "if the group is not trusted"
        )


def open_directory(path: str | os.PathLike[str], what: str, create: bool = False, consented: bool = False) -> Walk:
    """Walk `path` from `/`, judging every directory and link on the way (`judge_directory`); the
    directory's descriptor (O_PATH: usable as dir_fd=, with fstat). With `create`, missing
    directories are made (0700) as the walk goes; without it the walk stops at the first missing
    one (fd None: nothing there yet, and everything above it checked). `what` starts each line
    (e.g. "--log-dir /x"). Raises UnsafePath, or OSError when a part is not a directory.

    `consented`: the user accepted a path other users may change (--checkpoint-dir-shared): what
    would be refused is a warning line instead, and the directory is still opened (and then
    written through its descriptor, so nothing renamed in its path reaches the job's writes)."""
    parts = collections.deque(Path(os.path.abspath(path)).parts[1:])
    warnings: list[str] = []
    if consented:
        return _consented_walk(parts, path, what, create, warnings)
    return _walk(parts, path, what, create, warnings, judge_directory)


def _consented_walk(
    parts: collections.deque[str], path: str | os.PathLike[str], what: str, create: bool, warnings: list[str]
) -> Walk:
    def judge(info: os.stat_result, at: Path, what: str, warnings: list[str]) -> None:
        try:
            judge_directory(info, at, what, warnings)
        except UnsafePath as exc:
            warnings.append(str(exc))

    return _walk(parts, path, what, create, warnings, judge, trust_links=True)


def _walk(
    parts: collections.deque[str], path: str | os.PathLike[str], what: str, create: bool, warnings: list[str],
    judge: Callable[[os.stat_result, Path, str, list[str]], None], trust_links: bool = False,
) -> Walk:  # fmt: skip
    fd = os.open("/", _WALK_FLAGS)
    real = Path("/")
    links = 0
    try:
        judge(os.fstat(fd), real, what, warnings)
        while parts:
            name = parts.popleft()
            if name in ("", "."):
                continue
            try:
                child = os.open(name, _WALK_FLAGS, dir_fd=fd)
            except FileNotFoundError:
                if not create:
                    os.close(fd)
                    return Walk(None, real.joinpath(name, *parts), warnings)
                try:
                    os.mkdir(name, 0o700, dir_fd=fd)
                except FileExistsError:  # made at the same moment by another process: judged below
                    pass
                parts.appendleft(name)  # opened and judged on the next turn
                continue
            except OSError as exc:
                if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
                    raise
                info = os.stat(name, dir_fd=fd, follow_symlinks=False)
                if not stat.S_ISLNK(info.st_mode):
                    raise NotADirectoryError(errno.ENOTDIR, f"{real / name} is not a directory") from None
                if not trusted_owner(info.st_uid):
                    refusal = _refuse(what, real / name, f"is a link owned by uid {info.st_uid}")
                    if not trust_links:
                        raise refusal from None
                    warnings.append(str(refusal))
                links += 1
                if links > _MAX_LINKS:
                    raise OSError(errno.ELOOP, f"{path}: too many levels of symbolic links") from None
                target = Path(os.readlink(name, dir_fd=fd))
                parts.extendleft(reversed(target.parts[1:] if target.is_absolute() else target.parts))
                if target.is_absolute():
                    os.close(fd)
                    fd, real = os.open("/", _WALK_FLAGS), Path("/")
                continue
            os.close(fd)
            fd = child
            real = real.parent if name == ".." else real / name
            judge(os.fstat(fd), real, what, warnings)
        return Walk(fd, real, warnings)
    except BaseException:
        os.close(fd)
        raise


def check_directory(path: str | os.PathLike[str], what: str, warnings: list[str]) -> None:
    """`open_directory` without making anything: raise UnsafePath, or add its warning lines."""
    walk = open_directory(path, what)
    walk.close()
    warnings.extend(walk.warnings)


def check_secret_file(path: str | os.PathLike[str], what: str, warnings: list[str]) -> None:
    """A file a secret is read from (token_file, password_file): its directories by the rule
    above, and the file itself owned by this user or root (whoever owns it chooses the secret).
    A missing file is left to its reader, which says so."""
    full = Path(path).expanduser()
    for _ in range(_MAX_LINKS):
        walk = open_directory(full.parent, what)
        try:
            if walk.fd is None:
                return
            try:
                info = os.stat(full.name, dir_fd=walk.fd, follow_symlinks=False)
            except OSError:
                return
            found = walk.real / full.name
            if not trusted_owner(info.st_uid):
                kind = "a link" if stat.S_ISLNK(info.st_mode) else "a file"
                raise _refuse(what, found, f"is {kind} owned by uid {info.st_uid}, who could choose the secret")
            warnings.extend(walk.warnings)
            if not stat.S_ISLNK(info.st_mode):
                return
            full = walk.real / os.readlink(full.name, dir_fd=walk.fd)  # an absolute target replaces it all
        finally:
            walk.close()
    raise OSError(errno.ELOOP, f"{path}: too many levels of symbolic links")
