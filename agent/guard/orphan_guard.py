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
    PGID START     a worker started: it leads its session and process group PGID, and START is
                   its start time (/proc/PGID/stat field 22); `-PGID`: it stopped
    cleanup PATH   a file or directory to remove once the job's processes are dead (shared
                   memory a later part of the job keeps, say); `-cleanup PATH` forgets it

The guard kills only what it can prove is the job's, because a pid or a group id is a number the
kernel hands out again once it is free (pid_max is 32768 on many nodes): another user's process
may hold it by the time the guard acts. Proof is one of:

* membership of the job's cgroup;
* RALLY_AGENT_TOKEN=T in the environment (a random secret; only root and the job's user can read
  another process's environment);
* a worker itself: the guard holds a pidfd of each worker from its registration (opened, then
  its start time checked against START), so a signal through it can only reach that process;
  a worker that exits is forgotten at once (the pidfd turns readable);
* membership of a live worker's session or group (an id cannot be handed out again while a
  process uses it), and the processes the guard saw below the agent or in such a session while
  the agent lived, each with its start time, re-checked through a pidfd before the kill.

Every SEEN_INTERVAL seconds while the agent lives the guard notes the agent's descendants and the
members of the workers' sessions (with a cgroup too: a root worker can leave the cgroup by
writing to the hierarchy, and shed its session and the token). After the first, a look reads
only /proc's listing and the entries of the processes started since the last one (mostly none
while a job trains: `Orders._look_at_new` says why that finds the same). When the pipe reaches
end-of-file the agent is gone (however it died), and the guard SIGKILLs the job's cgroup, then
every process proven the job's as above, their descendants, and every process whose environment
carries the token, scanning again until none is left (a process may fork while being killed). What escapes:
a root process that leaves the cgroup, its session and the token within SEEN_INTERVAL of the
agent's death (or whose parent chain left the agent before the guard's last look). Then it removes
the cleanup paths and the cgroup, and exits.
It imports nothing heavy and ignores the terminal's and SLURM's signals, so it outlives the
agent long enough to do its one job. Run by file path (`python <rally>/agent/guard/orphan_guard.py`),
so it works from any installation and nothing on the user's path can stand in for it.
"""

from __future__ import annotations

import os
import select
import shutil
import signal
import time
from dataclasses import dataclass, field

if __package__:  # imported by the agent (guard/client.py)
    from rally.agent.guard.job_cgroup import JobCgroup
else:  # run by file path: its own directory is sys.path[0]
    from job_cgroup import JobCgroup  # type: ignore[no-redef,import-not-found]

TOKEN_VARIABLE = "RALLY_AGENT_TOKEN"
# How long the guard keeps scanning for marked processes after the agent died.
SWEEP_SECONDS = 2.0
# How often the guard notes the agent's descendants and the workers' sessions while the agent lives.
SEEN_INTERVAL = 0.5
# How long the guard tries to remove the emptied cgroup (dying members leave it with a delay).
REMOVE_WAIT_SECONDS = 10.0


@dataclass(frozen=True)
class Row:
    """One process in /proc: its parent, group, session and start time (clock ticks since boot)."""

    ppid: int
    pgrp: int
    session: int
    start: str
    zombie: bool


@dataclass
class Worker:
    """A registered worker, which leads session and group `pgid`; `pidfd` refers to it alone
    (-1 where the kernel has no pidfds: then its start time is checked before each signal)."""

    pgid: int
    start: str
    pidfd: int

    def alive(self) -> bool:
        if self.pidfd >= 0:
            # wait: not_a_wait: a poll of a pidfd, timeout 0
            return not select.select([self.pidfd], [], [], 0)[0]  # a pidfd turns readable at exit
        return start_time(self.pgid) == self.start and not _is_zombie(self.pgid)

    def kill(self) -> None:
        if self.pidfd >= 0:
            _signal_pidfd(self.pidfd)
        elif self.alive():
            _kill(self.pgid)

    def close(self) -> None:
        if self.pidfd >= 0:
            os.close(self.pidfd)
            self.pidfd = -1


@dataclass
class Orders:
    """What the agent told the guard so far (see the module's docstring), and what it saw."""

    token: str | None = None
    cgroup: JobCgroup | None = None
    workers: dict[int, Worker] = field(default_factory=dict)
    cleanup: list[str] = field(default_factory=list)
    seen: dict[int, str] = field(default_factory=dict)  # pid -> its start time: proven the job's
    listed: frozenset[int] = frozenset()  # the process ids in /proc at the last look

    def apply(self, word: bytes) -> None:
        text = word.decode(errors="replace")
        head = text.split(" ")
        if text.startswith("token "):
            self.token = text[6:]
        elif text.startswith("cgroup "):
            self.cgroup = JobCgroup.from_line(text[7:])
        elif text.startswith("cleanup "):
            self.cleanup.append(text[8:])
        elif text.startswith("-cleanup "):
            self.cleanup = [p for p in self.cleanup if p != text[9:]]
        elif text.startswith("-") and text[1:].isdigit():
            self.forget(int(text[1:]))
        elif head[0].isdigit():
            self.register(int(head[0]), head[1] if len(head) > 1 else None)

    def register(self, pgid: int, start: str | None) -> None:
        """Hold a pidfd of the worker `pgid` if it is still the process that started at `start`."""
        worker = claim(pgid, start)
        if worker is not None:
            self.forget(pgid)
            self.workers[pgid] = worker

    def forget(self, pgid: int) -> None:
        worker = self.workers.pop(pgid, None)
        if worker is not None:
            worker.close()

    def live_sessions(self) -> set[int]:
        """The sessions (= groups) of the workers alive now: those ids cannot belong to anyone else."""
        return {pgid for pgid, worker in self.workers.items() if worker.alive()}

    def look(self, agent: int) -> None:
        """Note what is provably the job's now (see the module's docstring); forget exited workers,
        keeping the members of their sessions (an id is not handed out while a process uses it).
        Reads every process's /proc entry only at the first look and when a worker exited; else
        only those of the processes started since the last look (`_look_at_new`)."""
        exited = [p for p, w in self.workers.items() if not w.alive()]
        listed = process_ids()
        if exited or not self.listed:
            self._look_at_all(agent, listed, exited)
        elif not listed <= self.listed:
            self._look_at_new(agent, listed)

    def _look_at_all(self, agent: int, listed: frozenset[int], exited: list[int]) -> None:
        table = processes(listed)
        self.listed = listed
        for pgid in exited:
            self.seen.update(members(table, {pgid}))
            self.forget(pgid)
        kept = {pid: start for pid, start in self.seen.items() if pid in table and table[pid].start == start}
        self.seen = kept | proven(table, agent, self.live_sessions())

    def _look_at_new(self, agent: int, listed: frozenset[int]) -> None:
        """Add the processes started since the last look that are the job's: those in a live
        worker's session, and those whose parent is the agent or the job's. A process listed last
        time keeps what it was: not the job's then, it cannot have become so (the agent is a
        subreaper: its descendants stay below it, and no process joins a session but by a fork
        inside it), and the job's then, it still is (its id is not handed out again before the
        kernel went round all of pid_max). A new process whose parent this look cannot place (its
        parent started after the listing, or died as it was read) is looked at again next time."""
        new = listed - self.listed
        rows = {pid: row for pid in new if (row := _row(pid)) is not None}
        self.seen = {pid: start for pid, start in self.seen.items() if pid in listed and pid not in new}
        sessions = self.live_sessions()
        found = {pid: row.start for pid, row in rows.items() if row.session in sessions or row.pgrp in sessions}
        grew = True
        while grew:  # a new process's parent may itself be new
            grew = False
            for pid, row in rows.items():
                if pid not in found and (row.ppid == agent or row.ppid in self.seen or row.ppid in found):
                    found[pid], grew = row.start, True
        found.pop(os.getpid(), None)
        self.seen |= found
        known = self.listed | rows.keys() | {0}  # 0: a parent outside this pid namespace
        unplaced = {pid for pid, row in rows.items() if row.ppid not in known}
        self.listed = listed - (unplaced - found.keys())

    def pidfds(self) -> list[int]:
        return [w.pidfd for w in self.workers.values() if w.pidfd >= 0]


def claim(pid: int, start: str | None) -> Worker | None:
    """A Worker for `pid` if it runs and (when given) started at `start`, else None (it is gone,
    and its id may be another process's by now)."""
    fd = pidfd_open(pid)
    now = start_time(pid)  # read after the pidfd is open: both name the same process
    if now is None or (start is not None and now != start) or fd == -2:
        if fd >= 0:
            os.close(fd)
        return None
    return Worker(pid, now, fd)


def pidfd_open(pid: int) -> int:
    """A pidfd of `pid`; -1 where the kernel or Python has none, -2 when no such process runs."""
    try:
        return os.pidfd_open(pid)
    except ProcessLookupError:
        return -2
    except (AttributeError, OSError):
        return -1


def process_ids() -> frozenset[int]:
    """The id of every process this guard can see in /proc (one directory listing)."""
    return frozenset(int(name) for name in os.listdir("/proc") if name.isdigit())


def processes(pids: frozenset[int] | None = None) -> dict[int, Row]:
    """Every process this guard can see in /proc (of `pids`, a listing just taken, when given)."""
    table: dict[int, Row] = {}
    for pid in process_ids() if pids is None else pids:
        row = _row(pid)
        if row is not None:
            table[pid] = row
    return table


def _row(pid: int) -> Row | None:
    fields = _stat_fields(pid)
    if not fields or len(fields) < 20:
        return None
    state, ppid, pgrp, session = fields[0], int(fields[1]), int(fields[2]), int(fields[3])
    return Row(ppid, pgrp, session, fields[19], state in ("Z", "X"))


def members(table: dict[int, Row], sessions: set[int]) -> dict[int, str]:
    """Processes in one of `sessions` (as session or as process group), with their start times."""
    return {pid: row.start for pid, row in table.items() if row.session in sessions or row.pgrp in sessions}


def proven(table: dict[int, Row], agent: int, sessions: set[int], roots: tuple[int, ...] = ()) -> dict[int, str]:
    """The agent's descendants, the members of `sessions`, `roots` and everything below them
    (never this process), with their start times."""
    children: dict[int, list[int]] = {}
    for pid, row in table.items():
        children.setdefault(row.ppid, []).append(pid)
    todo = [*children.get(agent, []), *members(table, sessions), *roots]
    found: dict[int, str] = {}
    while todo:
        pid = todo.pop()
        if pid != os.getpid() and pid not in found and pid in table:
            found[pid] = table[pid].start
            todo.extend(children.get(pid, []))
    return found


def descendants(root: int) -> dict[int, str]:
    """Every process below `root` (but this one), with its start time, from /proc."""
    return proven(processes(), root, set())


def _marked(pid: int, needle: bytes) -> bool:
    if pid == os.getpid():
        return False
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            environ = f.read()
    except OSError:
        return False
    return b"\0" + needle + b"\0" in b"\0" + environ + b"\0"


def sweep(orders: Orders, seconds: float = SWEEP_SECONDS) -> None:
    """SIGKILL the cgroup, then what is proven the job's (workers through their pidfds, the
    processes seen, the live workers' sessions and what is below them), then every marked
    process until a scan finds none (bounded); then remove the cleanup paths and the cgroup."""
    if orders.cgroup is not None:
        orders.cgroup.kill()
    table = processes()
    sessions = orders.live_sessions()  # checked after the scan: alive during it
    seen = tuple(pid for pid, start in orders.seen.items() if pid in table and table[pid].start == start)
    targets = proven(table, -1, sessions, seen)  # and what they started since the last look
    for worker in orders.workers.values():
        worker.kill()
    for pid, start in targets.items():
        kill_if_same(pid, start)
    deadline = time.monotonic() + seconds
    needle = f"{TOKEN_VARIABLE}={orders.token}".encode() if orders.token else None
    while time.monotonic() < deadline:
        table = processes()
        left = {pid: row.start for pid, row in table.items() if not row.zombie and pid in targets}
        left |= {pid: s for pid, s in proven(table, -1, sessions).items() if not table[pid].zombie}
        if needle is not None:
            left |= {pid: row.start for pid, row in table.items() if not row.zombie and _marked(pid, needle)}
        left = {pid: start for pid, start in left.items() if pid != os.getpid()}
        if not left:
            break
        for pid, start in left.items():
            kill_if_same(pid, start, needle if pid not in targets else None)
        # wait: short: 10 ms between sweeps, bounded by SWEEP_SECONDS
        time.sleep(0.01)
    for path in orders.cleanup:
        _remove(path)
    if orders.cgroup is not None:
        orders.cgroup.remove(wait=REMOVE_WAIT_SECONDS)


def kill_if_same(pid: int, start: str, needle: bytes | None = None) -> None:
    """SIGKILL `pid` only if it is still the process that started at `start` (and, given a
    `needle`, still carries it in its environment): checked after a pidfd of it is open, and the
    signal goes through that pidfd, so a recycled id never receives it."""
    fd = pidfd_open(pid)
    try:
        if fd == -2 or start_time(pid) != start or (needle is not None and not _marked(pid, needle)):
            return
        if fd >= 0:
            _signal_pidfd(fd)
        else:
            _kill(pid)
    finally:
        if fd >= 0:
            os.close(fd)


def _signal_pidfd(fd: int) -> None:
    try:
        signal.pidfd_send_signal(fd, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
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
    """/proc/PID/stat from the state on (index 0: state, 1: ppid, 2: pgrp, 3: session, 19: start time).
    Read with os.read: a first look reads every process's, and pathlib's text layers cost 3x that."""
    try:
        fd = os.open(f"/proc/{pid}/stat", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        data = os.read(fd, 4096)  # ~300 bytes, returned whole
    except OSError:
        return None
    finally:
        os.close(fd)
    return data.rpartition(b")")[2].decode("ascii", "replace").split()


def start_time(pid: int) -> str | None:
    """When `pid` started (clock ticks since boot, /proc/PID/stat field 22); None when it is gone."""
    fields = _stat_fields(pid)
    return fields[19] if fields and len(fields) > 19 else None


def _is_zombie(pid: int) -> bool:
    fields = _stat_fields(pid)
    return not fields or fields[0] in ("Z", "X")


def watch(orders: Orders, agent: int) -> None:
    """Read the agent's orders until end-of-file; meanwhile note what is the job's every
    SEEN_INTERVAL, and at once when a worker exits (its pidfd turns readable)."""
    pending = b""
    next_look = 0.0
    while True:
        # wait: background: the guard waits for its agent's pipe to close, a worker's exit (pidfd), or SEEN_INTERVAL
        ready = select.select([0, *orders.pidfds()], [], [], max(0.0, next_look - time.monotonic()))[0]
        if 0 not in ready:
            orders.look(agent)
            next_look = time.monotonic() + SEEN_INTERVAL
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
