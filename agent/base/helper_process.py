"""A helper child of the agent fed lines on a pipe: the orphan guard (agent/guard/client.py) and the
checkpoint holder (agent/checkpoint/node_checkpoints.py) are started, told things and stopped the same way.

Why this shape: a helper runs by file path (it works from any installation, and no module on the
user's path, an `agent` package say, can take its place), in a session of its own (a signal or a
SIGKILL to the agent's process group must not reach it), and reads its stdin: the end of that
pipe is how it learns the agent is gone, however the agent died.

The agent never blocks on a helper: its lines go into a
non-blocking pipe, so a helper that stopped reading (SIGSTOPped, starved, stuck) costs a dropped
line and, once, a warning, never the agent's main loop; stopping one is bounded and says so when
the helper had to be killed.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import IO


class HelperProcess:
    """`python <script> ARGS...` with a pipe to its stdin; `stdout` as for subprocess.Popen."""

    def __init__(
        self, script: str, *args: str, stdout: int | IO[bytes] | None = subprocess.DEVNULL,
        pass_fds: tuple[int, ...] = (), env: dict[str, str] | None = None, name: str = "",
        warn: Callable[[str], None] | None = None,
    ) -> None:  # fmt: skip
        """`pass_fds`: descriptors the helper inherits (the holder's socket); `env`: its environment
        (secrets go there, never into ARGS: a command line is every user's to read); `name` is
        what a line calls it ("the orphan guard"), `warn` hears that line."""
        self.process: subprocess.Popen[bytes] = subprocess.Popen(
            [sys.executable, str(Path(script).resolve()), *args],
            stdin=subprocess.PIPE,
            stdout=stdout,
            start_new_session=True,
            pass_fds=pass_fds,
            env=env,
        )
        self.name = name or Path(script).stem
        self.warn = warn
        self.dropped = 0  # lines the helper did not take (its pipe was full)
        assert self.process.stdin is not None
        os.set_blocking(self.process.stdin.fileno(), False)

    @property
    def pid(self) -> int:
        return self.process.pid

    def send(self, line: str) -> bool:
        """Write one line (a newline is added if missing); False when the helper is gone, or when
        it does not read (its pipe is full: the line is dropped, and said once). A line of at
        most PIPE_BUF bytes goes in whole or not at all."""
        data = (line if line.endswith("\n") else line + "\n").encode()
        try:
            assert self.process.stdin is not None
            os.write(self.process.stdin.fileno(), data)
            return True
        except BlockingIOError:
            self.dropped += 1
            if self.dropped == 1 and self.warn is not None:
                self.warn(
                    f"{self.name} (pid {self.pid}, {state_of(self.pid)}) does not read what the agent tells it "
                    "(its pipe is full); the agent goes on without waiting for it"
                )
            return False
        except (OSError, ValueError):
            return False

    def stop(self, timeout: float) -> bool:
        """Close the pipe (the helper's signal to finish) and wait for it; killed if not ended within
        `timeout` (one line, when `warn` was given). True when it ended by itself."""
        try:
            assert self.process.stdin is not None
            self.process.stdin.close()  # nothing buffered: lines are written straight to the descriptor
        except OSError:
            pass
        try:
            # wait: short: the caller's timeout (guard SWEEP_SECONDS + 3, holder 5 s), then SIGKILL
            self.process.wait(timeout=timeout)
            return True
        except subprocess.TimeoutExpired:
            state = state_of(self.pid)
            self.process.kill()
            if self.warn is not None:
                self.warn(f"{self.name} (pid {self.pid}, {state}) did not stop within {timeout:g} s; killed it")
            # wait: short: the caller's timeout (guard SWEEP_SECONDS + 3, holder 5 s), then SIGKILL
            self.process.wait()
            return False


def state_of(pid: int) -> str:
    """The helper's scheduler state in words ("stopped (SIGSTOP)"), from /proc (one short read)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            letter = stat.read().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return "exited"
    return {"T": "stopped (SIGSTOP)", "t": "stopped (traced)", "D": "in uninterruptible sleep (D)"}.get(
        letter, "running"
    )
