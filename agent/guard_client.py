"""The agent's side of the orphan guard (agent/orphan_guard.py): start it, tell it about each
worker group, stop it at exit. The guard itself runs by file path, so it imports none of this."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

from rally.agent import orphan_guard
from rally.agent.orphan_guard import SWEEP_SECONDS, TOKEN_VARIABLE

__all__ = ["GuardClient", "TOKEN_VARIABLE"]


class GuardClient:
    """The agent's side: start the guard, tell it about worker groups, stop it at exit."""

    def __init__(self, token: str):
        self.token = token
        self.process: Any = subprocess.Popen(
            # By file path, as the workers' bootstrap: works from any installation, and no
            # module on the user's path (an `agent` package, say) can take its place.
            [sys.executable, str(Path(orphan_guard.__file__).resolve())],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
        )
        self._tell(f"token {token}\n")

    @property
    def pid(self) -> int:
        return self.process.pid

    def guard_group(self, pgid: int) -> None:
        self._tell(f"{pgid}\n")

    def unguard_group(self, pgid: int) -> None:
        self._tell(f"-{pgid}\n")

    def _tell(self, line: str) -> None:
        if self.process.stdin is not None:
            try:
                self.process.stdin.write(line.encode())
                self.process.stdin.flush()
            except OSError:
                pass

    def stop(self, timeout: float = SWEEP_SECONDS + 3.0) -> None:
        """Close the pipe (the guard sweeps what is left, normally nothing) and wait, bounded."""
        try:
            self.process.stdin.close()
        except OSError:
            pass
        try:
            self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
