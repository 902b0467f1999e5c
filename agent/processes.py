"""Starting and stopping worker processes so that none is ever left behind.

Each worker leads its own session and process group, so a signal to the group reaches the
worker and everything it started (DataLoader workers, shells, compilers). Each worker also
asks the kernel for SIGKILL when its parent dies (PR_SET_PDEATHSIG), so SIGKILL of the agent
takes the workers with it. The agent itself is a child subreaper: orphans of a dying worker
are re-parented to the agent, where `stop_tree` still finds them.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from typing import IO, Sequence

import psutil

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36

_libc = ctypes.CDLL(None, use_errno=True)


def become_subreaper() -> None:
    """Orphaned descendants of our workers get re-parented to us instead of to init."""
    _libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def _die_with_parent(parent_pid: int) -> None:
    """Runs in the child between fork and exec: SIGKILL when the agent (its parent) dies."""
    _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent_pid:  # the agent died before the prctl took effect
        os._exit(1)


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
        if self.popen.returncode is None and self.popen.poll() is not None:
            self.ended_at = time.monotonic()
        return self.popen.returncode

    def wait(self) -> int:
        """Block until the process has exited and been reaped; return its returncode."""
        self.popen.wait()
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
    popen = subprocess.Popen(
        list(argv),
        env=env,
        cwd=cwd,
        stdout=stdout,
        stderr=stderr,
        start_new_session=True,
        preexec_fn=lambda: _die_with_parent(parent),
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


def kill_all(children: Sequence[ChildProcess], tree: dict[int, psutil.Process], keep: frozenset[int]) -> None:
    """SIGKILL each child's group, every listed descendant and every orphan re-parented to us.

    Returns when all of them are dead and reaped. `keep` names the agent's own helper
    processes, which belong to no worker.
    """
    for child in children:
        if child.poll() is None:
            tree.update({p.pid: p for p in _descendants(child.pid)})
            send_to_group(child.pid, signal.SIGKILL)
    for proc in tree.values():
        try:
            proc.kill()
        except psutil.Error:
            pass
    for child in children:
        child.wait()
    reap_orphans(keep | {c.pid for c in children})


def reap_orphans(keep: frozenset[int] | set[int]) -> None:
    """Kill and reap the worker descendants that were re-parented to this (subreaper) agent."""
    for proc in psutil.Process().children():
        if proc.pid in keep:
            continue
        try:
            if proc.status() != psutil.STATUS_ZOMBIE:
                proc.kill()
            os.waitpid(proc.pid, 0)
        except (psutil.Error, ChildProcessError):
            pass
