"""Specification: the agent's console writes are whole, even when signals cut pipe writes short.

Under PYTHONUNBUFFERED=1 (common in training images, sbatch scripts and `python -u`) the agent's
sys.stdout.buffer is a raw FileIO. A raw write to a full pipe returns early, with a short count,
when a signal arrives (the agent gets a SIGCHLD per worker exit); a caller that ignores the count
loses the rest. These tests write through a real pipe with a slow reader while real signals
arrive, first showing the raw stream does come back short there, then that the
agent's console writer (`WholeWrites`) loses and repeats nothing; and the same through a pipe
another process made non-blocking.
"""

from __future__ import annotations

import fcntl
import io
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest

from rally.agent.rounds.output import WholeWrites
from support.helpers import over_and_over

PAYLOAD = b"".join(b"line %06d " % i + b"x" * 100 + b"\n" for i in range(20000))  # ~2.2 MB


@contextmanager
def slow_pipe(nonblocking: bool = False) -> Iterator[tuple[io.FileIO, bytearray]]:
    """A pipe whose reader takes 4 KiB at a time with a pause, so the writer keeps finding it full;
    yields the write end as the raw stream PYTHONUNBUFFERED gives, and what the reader got."""
    read_fd, write_fd = os.pipe()
    if nonblocking:
        fcntl.fcntl(write_fd, fcntl.F_SETFL, fcntl.fcntl(write_fd, fcntl.F_GETFL) | os.O_NONBLOCK)
    received = bytearray()

    def read_all() -> None:
        while chunk := os.read(read_fd, 4096):
            received.extend(chunk)
            time.sleep(0.0001)

    reader = threading.Thread(target=read_all, daemon=True)
    reader.start()
    stream = io.FileIO(write_fd, "wb")
    try:
        yield stream, received
    finally:
        stream.close()
        reader.join(timeout=30)
        os.close(read_fd)
    assert not reader.is_alive()


@contextmanager
def signals_every_half_millisecond() -> Iterator[list[int]]:
    """A real SIGUSR1 to this (main) thread every 0.5 ms with a Python handler (as the agent's
    SIGCHLD handler is), so blocked pipe writes are interrupted; yields the list the handler
    counts into. Not SIGALRM: pytest-timeout's own timer uses it."""
    delivered: list[int] = []
    previous = signal.signal(signal.SIGUSR1, lambda signum, frame: delivered.append(signum))
    target = threading.get_ident()
    try:
        with over_and_over([(lambda: signal.pthread_kill(target, signal.SIGUSR1), 0.0005)]):
            yield delivered
    finally:
        signal.signal(signal.SIGUSR1, previous)


def write_under_signals(
    write: Callable[[io.FileIO], int | None], nonblocking: bool = False
) -> tuple[int | None, bytes, int]:
    with slow_pipe(nonblocking) as (stream, received):
        with signals_every_half_millisecond() as delivered:
            count = write(stream)
    return count, bytes(received), len(delivered)


@pytest.mark.timeout(60)
def test_a_raw_pipe_write_comes_back_short_when_signals_arrive() -> None:
    """The hazard is real on this kernel: without a loop, bytes are lost."""
    for _ in range(5):
        count, received, delivered = write_under_signals(lambda stream: stream.write(PAYLOAD))
        assert delivered > 0
        assert count is not None and received == PAYLOAD[:count]
        if count < len(PAYLOAD):
            return
    pytest.fail("five 2 MB raw writes to a slow pipe under SIGALRM all completed: the setup no longer shows the hazard")


@pytest.mark.timeout(60)
def test_the_console_writer_delivers_every_byte_once_in_order_through_interrupted_writes() -> None:
    for _ in range(3):
        count, received, delivered = write_under_signals(lambda stream: WholeWrites(stream).write(PAYLOAD))
        assert delivered > 0, "no signal arrived during the write: the test shows nothing"
        assert count == len(PAYLOAD)
        assert received == PAYLOAD


@pytest.mark.timeout(60)
@pytest.mark.parametrize("buffered", [False, True], ids=["raw", "buffered"])
def test_the_console_writer_waits_out_a_pipe_someone_made_non_blocking(buffered: bool) -> None:
    """O_NONBLOCK belongs to the pipe, shared by every process that holds it: when it is full a
    raw write returns None, and a BufferedWriter (the console without PYTHONUNBUFFERED) raises
    BlockingIOError with the count it took; the writer waits either out instead of dropping."""

    def write_and_flush(stream: io.FileIO) -> int:
        sink = WholeWrites(io.BufferedWriter(stream) if buffered else stream)
        count = sink.write(PAYLOAD)
        sink.flush()
        return count

    count, received, _ = write_under_signals(write_and_flush, nonblocking=True)
    assert count == len(PAYLOAD)
    assert received == PAYLOAD


# A process that writes PAYLOAD to its stdout as text while SIGALRM arrives every 0.5 ms; with
# "whole" it first calls rally's entry-point fix-up, as `rally` does before anything else.
TEXT_WRITER = """
import signal, sys
if sys.argv[1] == "whole":
    from rally.launcher.entry import whole_standard_streams
    whole_standard_streams()
signal.signal(signal.SIGALRM, lambda signum, frame: None)
signal.setitimer(signal.ITIMER_REAL, 0.0005, 0.0005)
sys.stdout.write(sys.stdin.read())
sys.stdout.flush()
signal.setitimer(signal.ITIMER_REAL, 0, 0)
"""


def text_written_by_an_unbuffered_process(mode: str) -> bytes:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with subprocess.Popen(
        [sys.executable, "-c", TEXT_WRITER, mode], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env
    ) as child:
        assert child.stdin is not None and child.stdout is not None
        child.stdin.write(PAYLOAD)
        child.stdin.close()
        received = bytearray()
        while chunk := os.read(child.stdout.fileno(), 4096):  # a slow reader: the pipe stays full
            received.extend(chunk)
            time.sleep(0.0001)
        assert child.wait(timeout=30) == 0
    return bytes(received)


@pytest.mark.timeout(60)
def test_unbuffered_text_output_loses_bytes_to_signals_without_the_fix_up() -> None:
    """What rally's own messages (a long failure report on stderr) would suffer under
    PYTHONUNBUFFERED: Python's text layer ignores a raw stream's short write."""
    assert any(text_written_by_an_unbuffered_process("plain") != PAYLOAD for _ in range(5)), (
        "five unbuffered 2 MB writes under SIGALRM all arrived whole: the setup no longer shows the hazard"
    )


@pytest.mark.timeout(60)
def test_rally_entry_makes_unbuffered_standard_streams_write_every_byte() -> None:
    for _ in range(3):
        assert text_written_by_an_unbuffered_process("whole") == PAYLOAD
