"""A helper child of the agent fed lines on a pipe: the orphan guard (agent/guard/client.py) and the
checkpoint holder (agent/checkpoint/node_checkpoints.py) are started, told things and stopped the same way.

Why this shape: a helper runs by file path (it works from any installation, and no module on the
user's path, an `agent` package say, can take its place), in a session of its own (a signal or a
SIGKILL to the agent's process group must not reach it), and reads its stdin: the end of that
pipe is how it learns the agent is gone, however the agent died.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import IO


class HelperProcess:
    """`python <script> ARGS...` with a pipe to its stdin; `stdout` as for subprocess.Popen."""

    def __init__(
        self, script: str, *args: str, stdout: int | IO[bytes] | None = subprocess.DEVNULL,
        pass_fds: tuple[int, ...] = (), env: dict[str, str] | None = None,
    ) -> None:  # fmt: skip
        """`pass_fds`: descriptors the helper inherits (the holder's socket); `env`: its environment
        (secrets go there, never into ARGS: a command line is every user's to read)."""
        self.process: subprocess.Popen[bytes] = subprocess.Popen(
            [sys.executable, str(Path(script).resolve()), *args],
            stdin=subprocess.PIPE,
            stdout=stdout,
            start_new_session=True,
            pass_fds=pass_fds,
            env=env,
        )

    @property
    def pid(self) -> int:
        return self.process.pid

    def send(self, line: str) -> bool:
        """Write one line (a newline is added if missing); False when the helper is gone."""
        try:
            assert self.process.stdin is not None
            self.process.stdin.write((line if line.endswith("\n") else line + "\n").encode())
            self.process.stdin.flush()
            return True
        except (OSError, ValueError):
            return False

    def stop(self, timeout: float) -> None:
        """Close the pipe (the helper's signal to finish) and wait for it; killed if not ended within `timeout`."""
        try:
            assert self.process.stdin is not None
            self.process.stdin.close()
        except OSError:
            pass
        try:
            # wait: short: the caller's timeout (guard SWEEP_SECONDS + 3, holder 5 s), then SIGKILL
            self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            # wait: short: the caller's timeout (guard SWEEP_SECONDS + 3, holder 5 s), then SIGKILL
            self.process.wait()
