"""The job's --checkpoint-dir, opened once and written through its descriptor for the whole job.

Why: the launcher judges the checkpoint directory and its ancestors at start-up (ssh's StrictModes
rule, rendezvous/base/path_trust.py), but a group-writable ancestor is accepted with a warning (a
team's project directory), and with --checkpoint-dir-shared so is one another user owns. Whoever
may rename entries there can, mid-job, move the checkpoint directory away and put a link to a
directory of their choice in its place: a job run by root would then write its checkpoints (0600
files, but named and placed by rally) into that directory, and the next run would resume from
whatever the other user left at the name.

So the agent opens the directory once (each part opened with O_PATH | O_DIRECTORY | O_NOFOLLOW
relative to the one above, made 0700 when missing, judged by what was opened) and keeps it open
for the job's lifetime. Everything of rally's that writes there (the workers' `rally.job.save`,
the holder's persister, the sharded writers and the end-of-job flush helper) is handed
`/proc/<agent pid>/fd/<n>` instead of the name: the kernel resolves that to the directory the
agent holds, never to what now has its name, the same way the run directory is written
(agent/rounds/workers.py's LogLayout). Below it, every file is created with O_EXCL | O_NOFOLLOW
and renamed into place (a rename replaces a planted link, it never follows one).

The limit: a script's own writes that build paths from the directory's name rather than from
RALLY_CHECKPOINT_DIR (which holds the /proc path) go by path; the start-up check of the
ancestors is all that protects them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass
class HeldDirectory:
    """The checkpoint directory as the user named it (`given`) and as the job writes it (`path`)."""

    given: str
    fd: int  # O_PATH, open for the agent's lifetime
    path: str  # /proc/<agent pid>/fd/<fd>

    @classmethod
    def open(cls, given: str, shared: bool) -> HeldDirectory:
        """Open (and make, 0700) `given`; raises UnsafePath or OSError as the launcher's check would.
        The warning lines were said by the launcher's check already, so none are kept here."""
        from rally.rendezvous.base.path_trust import open_directory  # the agent only: workers import `shown`

        walk = open_directory(given, f"--checkpoint-dir {given}", create=True, consented=shared)
        assert walk.fd is not None  # create=True: made or refused
        return cls(given, walk.fd, f"/proc/{os.getpid()}/fd/{walk.fd}")

    def real(self) -> str:
        """Where the held directory is now (its renamed place too), for people."""
        try:
            return os.readlink(self.path)
        except OSError:
            return self.given

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def moved_line(path: str, given: str) -> str | None:
    """One line when `given` no longer names the directory `path` (the held one) is: moved,
    replaced, or a link planted in its place; None while it does. Two stats: cheap for every round."""
    try:
        held = os.stat(path)
    except OSError:
        return None  # the agent that held it is gone: nothing to say from here
    try:
        named = os.stat(given)
        if (named.st_dev, named.st_ino) == (held.st_dev, held.st_ino):
            return None
    except OSError:
        pass
    return (
        f"--checkpoint-dir {given} was moved or replaced while the job ran (by someone who may write its "
        f"parent?): rally's checkpoints went on into the directory it opened at start, now {shown(path)}; "
        "nothing was written through what has the name now"
    )


def shown(path: str | os.PathLike[str] | None) -> str:
    """A path under `/proc/<pid>/fd/<n>` as a person can use it: under the directory's real path."""
    text = os.fspath(path) if path is not None else ""
    if text.startswith("/proc/") and "/fd/" in text:
        head, _, rest = text.partition("/fd/")
        number, _, tail = rest.partition("/")
        try:
            real = os.readlink(f"{head}/fd/{number}")
        except OSError:
            return text
        return real + ("/" + tail if tail else "")
    return text
