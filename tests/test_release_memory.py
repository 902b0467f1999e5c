"""A stopped worker's memory is freed by the agent as well as by the worker's own exit (the
stop of a restart is mostly the kernel tearing the stopped workers' address spaces
down), and only a worker already killed by its signal is touched (agent/base/linux.py
`release_memory`)."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from rally.agent.base import linux

HOLDS_MEMORY = """
    import signal, sys, time
    if sys.argv[1] == "handles":
        signal.signal(signal.SIGTERM, lambda *_: print("handled", flush=True))
    size = 300 << 20
    held = bytearray(size)
    held[::4096] = b"\\1" * (size // 4096)  # every page touched: private memory to free
    print("ready", flush=True)
    for line in sys.stdin:  # one line: check the memory, say so
        print("intact" if held.count(1) == size // 4096 else "changed", flush=True)
"""

pytestmark = pytest.mark.skipif(not linux.MRELEASE_AVAILABLE, reason="no process_mrelease on this architecture")


def _start(mode: str) -> tuple[subprocess.Popen, int]:
    child = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(HOLDS_MEMORY), mode],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    assert child.stdout is not None and child.stdout.readline() == "ready\n"
    return child, os.pidfd_open(child.pid)


def _end(child: subprocess.Popen, pidfd: int) -> None:
    os.close(pidfd)
    if child.poll() is None:
        child.kill()  # by its pid
    child.wait(10)


# Refused or done: decided by the signal the process got, not by the machine's load.
@pytest.mark.same_under_load
@pytest.mark.timeout(60)
def test_a_process_that_handles_its_stop_signal_is_not_touched() -> None:
    child, pidfd = _start("handles")
    try:
        child.send_signal(signal.SIGTERM)
        assert child.stdout is not None and child.stdout.readline() == "handled\n"
        assert linux.release_memory(pidfd) == errno.EINVAL, "the kernel freed the memory of a process still running"
        assert child.stdin is not None
        child.stdin.write("check\n")
        child.stdin.flush()
        assert child.stdout.readline() == "intact\n"
        assert child.poll() is None
    finally:
        _end(child, pidfd)


@pytest.mark.same_under_load
@pytest.mark.timeout(60)
def test_a_killed_process_has_its_memory_freed_from_here_and_still_exits() -> None:
    child, pidfd = _start("plain")
    try:
        child.send_signal(signal.SIGTERM)  # its default action: the process is dying from here on
        # freed, or its own exit was quicker (ESRCH); never refused (EINVAL) as a running process is
        assert linux.release_memory(pidfd) in (0, errno.ESRCH)
        assert child.wait(10) == -signal.SIGTERM
    finally:
        _end(child, pidfd)
