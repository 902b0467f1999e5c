"""A tiny watchdog process that kills everything the job started if the agent is SIGKILLed.

PR_SET_PDEATHSIG kills each worker when the agent dies, but not what the worker started (a data
loader, a shell pipeline, a daemon that called setsid and forked twice): those are re-parented
to init and would live on. While the agent lives it is a child subreaper, so every such process
stays in its tree and a stop finds it; once it is gone, only this guard is left to do the job.

The guard leads a session of its own, so a SIGKILL of the agent's process group (`timeout -s
KILL`, `kill -9 -PGID`) does not take it along. The agent starts it once (agent/guard/client.py),
with a pipe on its stdin, and tells it:

    token T        the value of RALLY_AGENT_TOKEN, which the agent puts in every worker's
                   environment (and so in everything the workers start that keeps it)
    cgroup K PATH  the job's own cgroup (agent/guard/job_cgroup.py): every worker and everything it
                   starts is in it, token or not, setsid'd or not
    PGID / -PGID   a worker's process group, started / stopped
    cleanup PATH   a file or directory to remove once the job's processes are dead (shared
                   memory a later part of the job keeps, say); `-cleanup PATH` forgets it

When the pipe reaches end-of-file the agent is gone (however it died), and the guard SIGKILLs
the job's cgroup, every group it was told about, every process whose /proc/PID/environ carries
the token, scanning again until none is left (a process may fork while being killed), and,
where no cgroup could be made, every descendant of the agent it saw while watching (it looks
every SEEN_INTERVAL seconds: what a worker started and disowned within the last interval before
the agent died may escape). Then it removes the cleanup paths and the cgroup, and exits.
It imports nothing heavy and ignores the terminal's and SLURM's signals, so it outlives the
agent long enough to do its one job. Run by file path (`python <rally>/agent/orphan_guard.py`),
so it works from any installation and nothing on the user's path can stand in for it.
"""

from __future__ import annotations

import os
import select
import shutil
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

if __package__:  # imported by the agent (guard/client.py)
    from rally.agent.guard.job_cgroup import JobCgroup
else:  # run by file path: its own directory is sys.path[0]
    from job_cgroup import JobCgroup  # type: ignore[no-redef,import-not-found]

TOKEN_VARIABLE = "RALLY_AGENT_TOKEN"
# How long the guard keeps scanning for marked processes after the agent died.
SWEEP_SECONDS = 2.0
# Without a cgroup: how often the guard lists the agent's descendants while the agent lives.
SEEN_INTERVAL = 0.5
# How long the guard tries to remove the emptied cgroup (dying members leave it with a delay).
REMOVE_WAIT_SECONDS = 10.0


@dataclass
class Orders:
    """What the agent told the guard so far (see the module's docstring)."""

    token: str | None = None
    cgroup: JobCgroup | None = None
    groups: set[int] = field(default_factory=set)
    cleanup: list[str] = field(default_factory=list)
    seen: dict[int, str] = field(default_factory=dict)  # pid -> its start time (no recycled pid)

    def apply(self, word: bytes) -> None:
        text = word.decode(errors="replace")
        if text.startswith("token "):
            self.token = text[6:]
        elif text.startswith("cgroup "):
            self.cgroup = JobCgroup.from_line(text[7:])
        elif text.startswith("cleanup "):
            self.cleanup.append(text[8:])
        elif text.startswith("-cleanup "):
            self.cleanup = [p for p in self.cleanup if p != text[9:]]
        elif text.startswith("-") and text[1:].isdigit():
            self.groups.discard(int(text[1:]))
        elif text.isdigit():
            self.groups.add(int(text))


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


def descendants(root: int) -> dict[int, str]:
    """Every process below `root` (but this one), with its start time, from /proc."""
    children: dict[int, list[int]] = {}
    started: dict[int, str] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        fields = _stat_fields(int(name))
        if fields:
            children.setdefault(int(fields[1]), []).append(int(name))
            started[int(name)] = fields[19]
    found: dict[int, str] = {}
    todo = list(children.get(root, []))
    while todo:
        pid = todo.pop()
        if pid != os.getpid() and pid not in found:
            found[pid] = started.get(pid, "")
            todo.extend(children.get(pid, []))
    return found


def sweep(orders: Orders, seconds: float = SWEEP_SECONDS) -> None:
    """SIGKILL the cgroup, the groups, the descendants seen, then every marked process until a
    scan finds none (bounded); then remove the cleanup paths and the cgroup."""
    if orders.cgroup is not None:
        orders.cgroup.kill()
    for pgid in orders.groups:
        _kill(pgid, group=True)
    for pid, start in orders.seen.items():
        fields = _stat_fields(pid)
        if fields and fields[19] == start:  # the same process, not a recycled pid
            _kill(pid)
    deadline = time.monotonic() + seconds
    while orders.token and time.monotonic() < deadline:
        alive = [pid for pid in marked_processes(orders.token) if not _is_zombie(pid)]
        if not alive:
            break
        for pid in alive:
            _kill(pid)
        time.sleep(0.01)
    for path in orders.cleanup:
        _remove(path)
    if orders.cgroup is not None:
        orders.cgroup.remove(wait=REMOVE_WAIT_SECONDS)


def _kill(pid: int, group: bool = False) -> None:
    try:
        (os.killpg if group else os.kill)(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _remove(path: str) -> None:
    try:
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            os.unlink(path)
    except OSError:
        pass


def _stat_fields(pid: int) -> list[str] | None:
    """/proc/PID/stat from the state on (index 0: state, 1: ppid, 19: start time)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return None


def _is_zombie(pid: int) -> bool:
    fields = _stat_fields(pid)
    return not fields or fields[0] in ("Z", "X")


def watch(orders: Orders, agent: int) -> None:
    """Read the agent's orders until end-of-file; without a cgroup, note its descendants meanwhile."""
    pending = b""
    while True:
        interval = SEEN_INTERVAL if orders.cgroup is None else None
        if not select.select([0], [], [], interval)[0]:
            orders.seen = descendants(agent)  # a subreaper's tree keeps all it had: the last look suffices
            continue
        data = os.read(0, 65536)
        if not data:  # the agent closed the pipe or died
            return
        *lines, pending = (pending + data).split(b"\n")
        for line in lines:
            if line.strip():
                orders.apply(line.strip())


def main() -> None:
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(signum, signal.SIG_IGN)
    orders = Orders()
    watch(orders, os.getppid())
    sweep(orders)


if __name__ == "__main__":
    main()
