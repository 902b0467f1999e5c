"""Worker output: whole lines to the console with a prefix, exact bytes to log files.

The agent reads every worker pipe in its one event loop and writes each complete line with a
single write call, so two workers' bytes never mix within a line. A line still open when its
worker exits is finished with a newline. The last lines of each worker's stderr are kept in
memory for the root-cause report, so a failure can be explained even without log files.
"""

from __future__ import annotations

import os
from collections import deque
from dataclasses import dataclass, field
from typing import BinaryIO

TAIL_LINES = 40
READ_CHUNK = 65536


@dataclass
class OutputStream:
    """One worker pipe (stdout or stderr) and where its bytes go."""

    fd: int
    console: BinaryIO | None  # None: not shown on the console (filtered or redirect-only)
    prefix: bytes = b""
    whole_lines: bool = True  # False (--no-prefix): pass bytes through as they arrive
    file: BinaryIO | None = None  # --tee: an exact copy of everything
    tail: deque[bytes] | None = None
    _partial: bytes = b""
    open: bool = True

    def on_readable(self) -> bool:
        """Move what is available; return False once the worker closed the pipe."""
        try:
            data = os.read(self.fd, READ_CHUNK)
        except BlockingIOError:
            return True
        if not data:
            self.finish()
            return False
        if self.file is not None:
            self.file.write(data)
            self.file.flush()
        if not self.whole_lines:
            self._remember(data)
            if self.console is not None:
                self.console.write(data)
                self.console.flush()
            return True
        data = self._partial + data
        end = data.rfind(b"\n") + 1
        self._partial = data[end:]
        if end:
            lines = data[:end].splitlines(keepends=True)
            self._remember_lines(lines)
            if self.console is not None:
                self.console.write(b"".join(self.prefix + line for line in lines))
                self.console.flush()
        return True

    def finish(self) -> None:
        """End of stream: write the unfinished last line, if any, and close the pipe."""
        if self._partial:
            line = self._partial + b"\n"
            self._partial = b""
            self._remember_lines([line])
            if self.console is not None:
                self.console.write(self.prefix + line)
                self.console.flush()
        if self.open:
            os.close(self.fd)
            self.open = False
        if self.file is not None:
            self.file.close()
            self.file = None

    def _remember_lines(self, lines: list[bytes]) -> None:
        if self.tail is not None:
            self.tail.extend(lines)

    def _remember(self, data: bytes) -> None:
        if self.tail is not None:
            self.tail.extend(data.splitlines(keepends=True))


@dataclass
class WorkerOutput:
    """The output streams of one worker and where its stderr can be read back."""

    streams: list[OutputStream] = field(default_factory=list)
    stderr_tail: deque[bytes] = field(default_factory=lambda: deque(maxlen=TAIL_LINES))
    stderr_file: str | None = None  # set when stderr goes straight to a file (--redirects)

    def last_stderr_lines(self, count: int = 20) -> list[str]:
        if self.stderr_file:
            return _tail_of_file(self.stderr_file, count)
        return [line.decode(errors="replace").rstrip("\n") for line in list(self.stderr_tail)[-count:]]


def _tail_of_file(path: str, count: int) -> list[str]:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - 64 * 1024))
            data = f.read()
    except OSError:
        return []
    return [line.decode(errors="replace") for line in data.splitlines()[-count:]]
