"""Starting and stopping worker processes so that none is ever left behind.

Each worker leads its own session and process group, so a signal to the group reaches the
worker and everything it started (DataLoader workers, shells, compilers). Each worker also
asks the kernel for SIGKILL when its parent dies (PR_SET_PDEATHSIG), so SIGKILL of the agent
takes the workers with it (and the orphan guard, agent/guard/orphan_guard.py, what they started).

The agent itself is a child subreaper: every orphan of a worker's tree, a setsid'd and
double-forked daemon included, is re-parented to the agent, so while the agent lives, every
process the job started is in the agent's own process tree. A stop therefore ends with
`kill_descendants`, which SIGKILLs that whole tree (but the agent's helpers) until it is empty,
and `reap_zombies` collects re-parented orphans the moment they exit (on SIGCHLD). Every wait
here is bounded: a process stuck in uninterruptible sleep (D) is reported, not waited for.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import IO

import psutil

from rally.agent.base.linux import PR_SET_CHILD_SUBREAPER, PR_SET_PDEATHSIG, prctl
from rally.agent.base.numa import AFFINITY_VARIABLE, parse_cpus

# How long a stop waits for SIGKILLed processes to be gone (D-state ones may take longer).
KILL_WAIT_SECONDS = 5.0


def become_subreaper() -> None:
    """Orphaned descendants of our workers get re-parented to us instead of to init."""
    prctl(PR_SET_CHILD_SUBREAPER, 1)


# The job's cgroup's `cgroup.procs` (agent/guard/job_cgroup.py), set by the agent's GuardClient: every
# process started here joins it before exec, so all it starts can be found when the agent dies.
_job_cgroup_procs: str | None = None


def set_job_cgroup(procs_file: str | None) -> None:
    global _job_cgroup_procs
    _job_cgroup_procs = procs_file


def _die_with_parent(parent_pid: int, cpus: set[int] | None = None) -> None:
    """Runs in the child between fork and exec: SIGKILL when the agent (its parent) dies; into
    the job's cgroup; bound to `cpus` (--numa-binding) before exec, so every thread of the
    program inherits them."""
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:  # the agent died before the prctl took effect
        os._exit(1)
    if _job_cgroup_procs:
        try:
            fd = os.open(_job_cgroup_procs, os.O_WRONLY)
            try:
                os.write(fd, b"0")  # "0": this process
            finally:
                os.close(fd)
        except OSError:
            pass  # the guard still has the token and the process groups
    if cpus:
        os.sched_setaffinity(0, cpus)


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def describe_exit(returncode: int) -> str:
    """'exit code 3' or 'SIGKILL' (subprocess reports death by signal N as -N)."""
    return signal_name(-returncode) if returncode < 0 else f"exit code {returncode}"


def exit_status_for_shell(returncode: int) -> int:
    """The code a shell would report for this child: 128+N for death by signal N."""
    return 128 - returncode if returncode < 0 else returncode


@dataclass
class ChildProcess:
    """A started process, its pidfd (readable when it exits) and its start time."""

    popen: subprocess.Popen
    pidfd: int
    started_at: float = field(default_factory=time.monotonic)
    ended_at: float | None = None

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def returncode(self) -> int | None:
        return self.popen.returncode

    def poll(self) -> int | None:
        """Reap the process if it has exited (call when the pidfd is readable)."""
        # wait: not_a_wait: Popen.poll
        if self.popen.returncode is None and self.popen.poll() is not None:
            self.ended_at = time.monotonic()
        return self.popen.returncode

    def wait(self, timeout: float | None = None) -> int | None:
        """Wait (up to `timeout`) until the process has exited and been reaped; its returncode,
        or None if it is still there."""
        try:
            # wait: slice, said by the job: the caller's timeout
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            return None
        if self.ended_at is None:  # poll() cannot tell any more: wait() has set the returncode
            self.ended_at = time.monotonic()
        return self.popen.returncode

    def close(self) -> None:
        if self.pidfd >= 0:
            os.close(self.pidfd)
            self.pidfd = -1


def spawn(
    argv: Sequence[str],
    env: dict[str, str],
    cwd: str | None,
    stdout: int | IO | None,
    stderr: int | IO | None,
) -> ChildProcess:
    """Start `argv` as the leader of a new session that dies with this process."""
    parent = os.getpid()
    affinity = env.get(AFFINITY_VARIABLE)
    cpus = parse_cpus(affinity) if affinity else None
    popen = subprocess.Popen(
        list(argv),
        env=env,
        cwd=cwd,
        stdout=stdout,
        stderr=stderr,
        start_new_session=True,
        preexec_fn=lambda: _die_with_parent(parent, cpus),
        close_fds=True,
    )
    return ChildProcess(popen, os.pidfd_open(popen.pid))


def _descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


def send_to_group(pid: int, signum: int) -> None:
    """Signal the process group led by `pid` (the worker and whatever it started)."""
    try:
        os.killpg(pid, signum)
    except (ProcessLookupError, PermissionError):
        pass


def stop_group(pid: int, signum: int) -> None:
    """Send a stop signal to the group led by `pid`, then SIGCONT: a stopped (SIGSTOP) process
    only acts on a signal once continued, and would otherwise sit out the whole grace period."""
    send_to_group(pid, signum)
    if signum not in (signal.SIGKILL, signal.SIGCONT):
        send_to_group(pid, signal.SIGCONT)


def snapshot_descendants(children: Sequence[ChildProcess]) -> dict[int, psutil.Process]:
    """Every descendant of `children`, listed before they are signalled.

    Once a worker dies its children are re-parented and can no longer be found through it,
    so the list must be taken first.
    """
    tree: dict[int, psutil.Process] = {}
    for child in children:
        for proc in _descendants(child.pid):
            tree[proc.pid] = proc
    return tree


def kill_all(children: Sequence[ChildProcess], tree: dict[int, psutil.Process], keep: frozenset[int]) -> list[int]:
    """SIGKILL each child's group, every listed descendant and everything else below this agent.

    Returns when all of them are dead and reaped, or after KILL_WAIT_SECONDS with the pids
    still there. `keep` names the agent's own helper processes, which belong to no worker.
    """
    for child in children:
        # wait: not_a_wait: Popen.poll
        if child.poll() is None:
            tree.update({p.pid: p for p in _descendants(child.pid)})
            send_to_group(child.pid, signal.SIGKILL)
    for proc in tree.values():
        try:
            proc.kill()
        except psutil.Error:
            pass
    deadline = time.monotonic() + KILL_WAIT_SECONDS
    for child in children:
        # wait: short: up to the kill deadline
        child.wait(max(0.0, deadline - time.monotonic()))
    return kill_descendants(keep | {c.pid for c in children if c.returncode is None}, deadline)


def kill_descendants(keep: frozenset[int] | set[int], deadline: float | None = None) -> list[int]:
    """SIGKILL every process below this one (but `keep`) until none is left; reap our children.

    Works because the agent is a subreaper: nothing a worker started can leave its tree. Returns
    the pids still alive at the deadline (stuck in the kernel, D state).
    """
    deadline = time.monotonic() + KILL_WAIT_SECONDS if deadline is None else deadline
    me = psutil.Process()
    while True:
        try:
            below = [p for p in me.children(recursive=True) if p.pid not in keep]
        except psutil.Error:
            below = []
        alive = []
        for proc in below:
            try:
                if proc.status() != psutil.STATUS_ZOMBIE:
                    proc.kill()
                    alive.append(proc.pid)
            except psutil.Error:
                pass
        reap_zombies(keep)
        if not alive or time.monotonic() > deadline:
            return alive
        # wait: short: 5 ms between sweeps
        time.sleep(0.005)


def reap_zombies(keep: frozenset[int] | set[int]) -> list[int]:
    """Reap the exited orphans re-parented to this agent (never a pid in `keep`: workers are
    reaped by their own handles, which need the exit status)."""
    reaped: list[int] = []
    try:
        children = psutil.Process().children()
    except psutil.Error:
        return reaped
    for proc in children:
        if proc.pid in keep:
            continue
        try:
            # wait: not_a_wait: WNOHANG
            if proc.status() == psutil.STATUS_ZOMBIE and os.waitpid(proc.pid, os.WNOHANG)[0]:
                reaped.append(proc.pid)
        except (psutil.Error, ChildProcessError):
            pass
    return reaped


# /proc/PID/stat state letters, as a person would say them.
_STATES = {
    "R": "running",
    "S": "sleeping",
    "D": "uninterruptible sleep (D)",
    "T": "stopped (SIGSTOP)",
    "t": "stopped (traced)",
    "Z": "exited (zombie)",
    "X": "exited",
    "I": "idle",
}


def process_state(pid: int) -> str:
    """The process's scheduler state in words ("stopped (SIGSTOP)", "sleeping", ...)."""
    try:
        stat = open(f"/proc/{pid}/stat").read()  # one short read
    except OSError:
        return "exited"
    letter = stat.rpartition(")")[2].split()[0]
    return _STATES.get(letter, letter)
