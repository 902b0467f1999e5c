"""rally started in its own session, its output read line by line as it arrives (for timing faults)."""

from __future__ import annotations

import subprocess
import threading
import time
from pathlib import Path

from support.helpers import ProcessTracker, start_rally, wait_for


class LiveRally:
    """rally started in its own session, its merged output read line by line with arrival times."""

    def __init__(self, args: list[str], cwd: Path, env: dict[str, str], tracker: ProcessTracker):
        self.proc = start_rally(args, cwd=cwd, env=env, stderr=subprocess.STDOUT)
        tracker.track_group(self.proc.pid)
        self.lines: list[tuple[float, str]] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append((time.monotonic(), line.rstrip("\n")))

    def text(self) -> str:
        return "\n".join(line for _, line in self.lines)

    def wait_line(self, needle: str, timeout: float) -> float:
        """The time the first line containing `needle` arrived (fails the test after `timeout`)."""

        def seen() -> float | None:
            return next((t for t, line in self.lines if needle in line), None)

        try:
            return wait_for(seen, timeout, what=repr(needle))  # type: ignore[return-value]
        except BaseException:
            print(self.text()[-6000:])
            raise

    def wait_exit(self, timeout: float) -> tuple[int, float]:
        code = self.proc.wait(timeout=timeout)
        self.reader.join(timeout=5)
        return code, time.monotonic()
