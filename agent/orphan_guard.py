"""A tiny watchdog process that kills everything the workers started if the agent is SIGKILLed.

PR_SET_PDEATHSIG kills each worker when the agent dies, but not what the worker started (a data
loader, a shell pipeline, a daemon that called setsid and forked twice): those are re-parented
to init and would live on. While the agent lives it is a child subreaper, so every such process
stays in its tree and a stop finds it; once it is gone, only this guard is left to do the job.

The agent starts the guard once (agent/guard_client.py), with a pipe on its stdin, and tells it:

    token T        the value of RALLY_AGENT_TOKEN, which the agent puts in every worker's
                   environment (and so in everything the workers start, setsid'd or not)
    PGID / -PGID   a worker's process group, started / stopped

When the pipe reaches end-of-file the agent is gone (however it died), and the guard SIGKILLs
every group it was told about and every process whose /proc/PID/environ carries the token,
scanning again until none is left (a process may fork while being killed), then exits. Process
groups alone are not enough: a setsid'd grandchild has left its worker's group and session.
It imports nothing heavy and ignores the terminal's and SLURM's signals, so it outlives the
agent long enough to do its one job. Run by file path (`python <rally>/agent/orphan_guard.py`),
so it works from any installation and nothing on the user's path can stand in for it.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

TOKEN_VARIABLE = "RALLY_AGENT_TOKEN"
# How long the guard keeps scanning for marked processes after the agent died.
SWEEP_SECONDS = 2.0


def marked_processes(token: str) -> list[int]:
    """Pids whose environment carries RALLY_AGENT_TOKEN=token (processes we may read)."""
    needle = f"{TOKEN_VARIABLE}={token}".encode()
    found = []
    me = os.getpid()
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == me:
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                environ = f.read()
        except OSError:
            continue
        if b"\0" + needle + b"\0" in b"\0" + environ + b"\0":
            found.append(int(name))
    return found


def sweep(groups: set[int], token: str | None, seconds: float = SWEEP_SECONDS) -> None:
    """SIGKILL the groups, then every marked process, until a scan finds none (bounded)."""
    for pgid in groups:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    if not token:
        return
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        alive = [pid for pid in marked_processes(token) if not _is_zombie(pid)]
        if not alive:
            return
        for pid in alive:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        time.sleep(0.01)


def _is_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] in ("Z", "X")
    except (OSError, IndexError):
        return True


def main() -> None:
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(signum, signal.SIG_IGN)
    groups: set[int] = set()
    token: str | None = None
    for line in sys.stdin.buffer:  # returns at EOF: the agent closed the pipe or died
        word = line.strip()
        if word.startswith(b"token "):
            token = word[6:].decode()
        elif word.startswith(b"-"):
            groups.discard(int(word[1:]))
        elif word:
            groups.add(int(word))
    sweep(groups, token)


if __name__ == "__main__":
    main()
