"""Worker output: whole lines to the console with a prefix, exact bytes to log files.

The agent reads every worker pipe in its one event loop and writes each complete line with a
single write call, so two workers' bytes never mix within a line. A line still open when its
worker exits is finished with a newline. The last lines of each worker's stderr are kept in
memory for the root-cause report, so a failure can be explained even without log files.

Progress bars (tqdm, rich) redraw one line with carriage returns and no newline. Each piece
that ends in '\r' is written at once, with the prefix, and so is the redraw still open after
a '\r' (tqdm writes "\r 10%|#..." and then waits): it is written as prefix + text + '\r', so
every console write still ends the line it started and the next redraw replaces it. Output
that never ends a line is cut every MAX_PARTIAL_LINE bytes, so memory stays bounded.
"""

from __future__ import annotations

import os
import re
import select
import time
from collections import deque
from dataclasses import dataclass, field
from typing import BinaryIO, Protocol

from rally.agent.base.untrusted_files import open_regular, read_capped


class ByteSink(Protocol):
    """Where a worker's console lines go: a binary stream (sys.stdout.buffer) or the live view's
    sink (agent/observe/live.py), which prints them above its table."""

    def write(self, data: bytes, /) -> int: ...

    def flush(self) -> None: ...


class WholeWrites:
    """A console stream that writes every byte it is given, or raises.

    Under PYTHONUNBUFFERED=1 (set by many training images and sbatch scripts, and by `python -u`),
    sys.stdout.buffer is a raw FileIO, and a raw write to a pipe returns early, with a short
    count, when a signal (a worker's SIGCHLD) arrives while the pipe is full: the rest of the
    line was lost and the next line written after its first bytes. This loops until all is
    written, and waits for the pipe to drain if something else made it non-blocking (O_NONBLOCK
    belongs to the pipe, which every process holding it shares)."""

    def __init__(self, stream: BinaryIO):
        self.stream = stream

    def write(self, data: bytes, /) -> int:
        view = memoryview(data)
        while view:
            try:
                count = self.stream.write(view)
            except BlockingIOError as exc:  # a buffered stream took this much, then was full
                count = exc.characters_written
                self._writable()
            if count is None:  # a raw non-blocking stream, full: nothing taken
                self._writable()
                continue
            view = view[count:]
        return len(data)

    def flush(self) -> None:
        while True:
            try:
                self.stream.flush()
                return
            except BlockingIOError:
                self._writable()

    def _writable(self) -> None:
        """Return once the pipe takes bytes again, or after a second (the write is then retried:
        a console nobody reads holds rally's output back, as a blocking write would)."""
        # wait: short: 1 s, then the caller tries its write again
        select.select([], [self.stream], [], 1.0)


TAIL_LINES = 400  # enough for the stack dumps of a hung worker with a few threads
READ_CHUNK = 65536
# The longest unfinished line kept in memory; longer output without '\n' or '\r' is written
# to the console in pieces of this size, each ended with a newline.
MAX_PARTIAL_LINE = 65536
# Where a piece of a line ends: '\r\n', '\n' or '\r'.
_PIECE_END = re.compile(rb"\r\n|\n|\r")


class LineTail:
    """The last lines of a stream, plus a running count so a caller can ask "what came since"."""

    def __init__(self, maxlen: int = TAIL_LINES):
        self.lines: deque[bytes] = deque(maxlen=maxlen)
        self.total = 0

    def extend(self, lines: list[bytes]) -> None:
        self.lines.extend(lines)
        self.total += len(lines)

    def since(self, mark: int) -> list[bytes]:
        count = min(self.total - mark, len(self.lines))
        return list(self.lines)[len(self.lines) - count :] if count > 0 else []

    def last(self, count: int) -> list[bytes]:
        return list(self.lines)[-count:]


@dataclass
class OutputStream:
    """One worker pipe (stdout or stderr) and where its bytes go."""

    fd: int
    console: ByteSink | None  # None: not shown on the console (filtered or redirect-only)
    prefix: bytes = b""
    whole_lines: bool = True  # False (--no-prefix): pass bytes through as they arrive
    file: BinaryIO | None = None  # --tee: an exact copy of everything
    tail: LineTail | None = None
    # --duplicate-*-filters: (file, substrings); matching whole lines are copied there with
    # `duplicate_prefix` (torchrun's "[role<local_rank>]:").
    duplicate: tuple[BinaryIO, tuple[bytes, ...]] | None = None
    duplicate_prefix: bytes = b""
    _partial: bytes = b""
    _after_cr: bool = False  # the last piece ended in '\r': `_partial` is a progress redraw
    _shown: bytes | None = None  # the redraw already written to the console
    open: bool = True
    last_read_at: float = 0.0  # monotonic time of the last bytes seen (silence detection)

    def on_readable(self) -> bool:
        """Move what is available; return False once the worker closed the pipe."""
        try:
            data = os.read(self.fd, READ_CHUNK)
        except BlockingIOError:
            return True
        if not data:
            self.finish()
            return False
        self.last_read_at = time.monotonic()
        if self.file is not None:
            self.file.write(data)
            self.file.flush()
        if not self.whole_lines:
            self._remember(data)
            if self.console is not None:
                self.console.write(data)
                self.console.flush()
            return True
        self._take(self._partial + data)
        return True

    def _take(self, data: bytes) -> None:
        """Write every finished piece of `data`, then the open redraw; keep the rest."""
        out: list[bytes] = []
        lines: list[bytes] = []
        end = 0
        for match in _PIECE_END.finditer(data):
            piece = data[end : match.end()]
            end = match.end()
            if piece.endswith(b"\n"):
                lines.append(piece)
                out.append(self.prefix + piece)
                self._after_cr = False
            else:  # a progress redraw is done: show it, unless it is already on the console
                if piece[:-1] and piece[:-1] != self._shown:
                    out.append(self.prefix + piece)
                self._after_cr = True
            self._shown = None
        rest = data[end:]
        while len(rest) > MAX_PARTIAL_LINE:  # no line end in sight: bounded memory
            lines.append(rest[:MAX_PARTIAL_LINE] + b"\n")
            out.append(self.prefix + lines[-1])
            rest = rest[MAX_PARTIAL_LINE:]
        self._partial = rest
        if rest and self._after_cr and rest != self._shown:
            out.append(self.prefix + rest + b"\r")
            self._shown = rest
        self._remember_lines(lines)
        if out and self.console is not None:
            self.console.write(b"".join(out))
            self.console.flush()

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
        if self.duplicate is not None:
            file, needles = self.duplicate
            matching = [self.duplicate_prefix + line for line in lines if any(n in line for n in needles)]
            if matching:
                file.write(b"".join(matching))
                file.flush()

    def _remember(self, data: bytes) -> None:
        if self.tail is not None:
            self.tail.extend(data.splitlines(keepends=True))


@dataclass
class WorkerOutput:
    """The output streams of one worker and where its stderr can be read back."""

    streams: list[OutputStream] = field(default_factory=list)
    stderr_tail: LineTail = field(default_factory=LineTail)
    stderr_file: str | None = None  # set when stderr goes straight to a file (--redirects)
    file_paths: list[str] = field(default_factory=list)  # streams written straight to files
    # Where the worker's faulthandler writes the stacks the agent asks for (RALLY_STACK_FILE), so
    # they never reach its console or logs, where they would show a second time beside the report.
    stack_file: str | None = None

    def last_stderr_lines(self, count: int = 20) -> list[str]:
        if self.stderr_file:
            return _tail_of_file(self.stderr_file, count)
        return [line.decode(errors="replace").rstrip("\n") for line in self.stderr_tail.last(count)]

    def stderr_mark(self) -> int:
        """A position in stderr; `stderr_since(mark)` returns what the worker wrote after it."""
        if self.stderr_file:
            return _size_of(self.stderr_file)
        return self.stderr_tail.total

    def stderr_since(self, mark: int) -> list[str]:
        if self.stderr_file:
            return _lines_after(self.stderr_file, mark)
        return [line.decode(errors="replace").rstrip("\n") for line in self.stderr_tail.since(mark)]

    def stack_mark(self) -> int:
        """A position in the worker's stack file (its stderr without one); see `stack_since`."""
        if self.stack_file:
            return _size_of(self.stack_file)
        return self.stderr_mark()

    def stack_since(self, mark: int) -> list[str]:
        """The stack dump lines the worker wrote after `mark`."""
        if self.stack_file:
            return _lines_after(self.stack_file, mark)
        return self.stderr_since(mark)

    def last_output_at(self) -> float:
        """Monotonic time of the worker's latest output, on a pipe or in a redirected file."""
        latest = max((s.last_read_at for s in self.streams), default=0.0)
        for path in self.file_paths:
            try:
                age = time.time() - os.path.getmtime(path)
            except OSError:
                continue
            latest = max(latest, time.monotonic() - age)
        return latest


def _tail_of_file(path: str, count: int) -> list[str]:
    try:  # a regular file only, never a blocking open (agent/base/untrusted_files.py)
        data = read_capped(path, 64 * 1024, tail=True)
    except OSError:
        return []
    return [line.decode(errors="replace") for line in data.splitlines()[-count:]]


def _size_of(path: str) -> int:
    """The size of a worker's file now (0 when it is gone): a mark for `_lines_after`."""
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def _lines_after(path: str, mark: int) -> list[str]:
    """The lines of a worker's file after byte `mark`, at most 256 KiB of them. The worker may have
    replaced the file (a FIFO, a link): it is read as hostile, so a FIFO put there never blocks us."""
    try:
        fd = open_regular(path)
        try:
            data = os.pread(fd, 256 * 1024, mark)
        finally:
            os.close(fd)
    except OSError:
        return []
    return [line.decode(errors="replace") for line in data.splitlines()]
