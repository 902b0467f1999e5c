"""Reaching a TCPStore without hanging: every step of a connect is bounded and says what it waits for.

torch's TCPStore client constructor is not bounded by its own `timeout` once the TCP connection
is up: against a SIGSTOPped store (the kernel still accepts connections) or a port held by
another program (an HTTP server) it blocks for as long as the peer stays silent, measured here
past 60 s with a 3 s timeout. And while the port refuses, it retries silently for the whole
connect timeout (join_timeout, 600 s by default). So before torch connects, rally checks the
endpoint itself, with a plain socket:

1. connect until the port accepts, for at most `connect_timeout`; a refusal, an unreachable host
   or a name that does not resolve yet is retried, and every PROGRESS_SECONDS a line says what
   it waits for and until when;
2. ask it the cheapest c10d question (VALIDATE, then GETNUMKEYS: the query codes and magic number
   are the same from torch 2.4 to 2.15 and on both server back ends) and wait at most
   `answer_timeout` for its 8-byte answer: silence is a frozen store or a program that is not
   a store, bytes of another shape are certainly not a store;
3. only then run torch's constructor, itself in a thread bounded by `answer_timeout` (a store
   may freeze between 2 and 3; the abandoned thread is a daemon).
"""

from __future__ import annotations

import queue
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

# c10d's wire protocol (TCPStoreBackend.hpp): a query is one byte, VALIDATE carries a uint32.
QUERY_VALIDATE, QUERY_GETNUMKEYS = 0, 7
VALIDATION_MAGIC = 0x3C85F7CE
# How often a refused connect says that it is still waiting.
PROGRESS_SECONDS = 5.0
# The longest a store may take to answer its first question (less with a shorter read_timeout):
# a live store answers in milliseconds, so this only tells a frozen store or another program.
FIRST_ANSWER_SECONDS = 5.0
# Between connect attempts while the port refuses.
RETRY_SECONDS = 0.2
# How long a CallRunner's thread stays with nothing to do before it leaves (the next call starts one).
RUNNER_IDLE_SECONDS = 5.0
# The longest single connect attempt (a host that drops SYNs), so progress lines keep coming.
ATTEMPT_SECONDS = 5.0
# What torch's constructor gets beyond its own timeout before it counts as stuck.
CONSTRUCTOR_SLACK_SECONDS = 1.0


# Where the current thread's connects report progress (set by `reporting_progress`), so a
# caller far above the store backends (the agent) can hear it without every layer passing it on.
_reporter = threading.local()


@contextmanager
def reporting_progress(progress: Callable[[str], None] | None) -> Iterator[None]:
    """Within this block, this thread's connects say every few seconds what they wait for."""
    before = getattr(_reporter, "progress", None)
    _reporter.progress = progress
    try:
        yield
    finally:
        _reporter.progress = before


def current_progress() -> Callable[[str], None] | None:
    """Where this thread's `reporting_progress` block reports (None outside one). A store opened
    in the block keeps it for its own long waits (rendezvous/etcd/store.py)."""
    return getattr(_reporter, "progress", None)


class NoStoreThere(Exception):
    """The endpoint cannot be used as a store; the message says why, in one line."""


def wait_for_store(
    host: str,
    port: int,
    describe: str,
    connect_timeout: float,
    answer_timeout: float,
    progress: Callable[[str], None] | None = None,
) -> None:
    """Return once `host:port` accepts a connection and answers as a c10d store; else NoStoreThere."""
    answer_timeout = min(answer_timeout, FIRST_ANSWER_SECONDS)
    conn = _connect(host, port, describe, connect_timeout, progress or getattr(_reporter, "progress", None))
    try:
        conn.settimeout(answer_timeout)
        conn.sendall(struct.pack("<BIB", QUERY_VALIDATE, VALIDATION_MAGIC, QUERY_GETNUMKEYS))
        answer = b""
        while len(answer) < 8:
            # wait: short: the socket's timeout: min(read_timeout, 5 s)
            chunk = conn.recv(8 - len(answer))
            if not chunk:
                break
            answer += chunk
    except TimeoutError:
        raise NoStoreThere(
            f"{describe} accepted a connection but did not answer within {answer_timeout:g} s: the store is frozen "
            "(SIGSTOP, a stalled host), or what listens there is not a c10d store"
        ) from None
    except OSError as exc:
        raise NoStoreThere(
            f"{describe} dropped the connection ({exc.strerror or exc}): what listens there is not a c10d store"
        ) from None
    finally:
        conn.close()
    if len(answer) != 8 or struct.unpack("<q", answer)[0] < 0:
        shown = answer[:16].decode("ascii", errors="replace").strip() or "nothing"
        raise NoStoreThere(
            f"{describe} answered like no c10d store (it sent {shown!r}): another program holds that port"
        )


def _connect(
    host: str, port: int, describe: str, connect_timeout: float, progress: Callable[[str], None] | None
) -> socket.socket:
    """A connected socket, retrying what may still change (refused, unreachable, unresolved)."""
    deadline = time.monotonic() + connect_timeout
    next_line = time.monotonic() + PROGRESS_SECONDS
    while True:
        left = deadline - time.monotonic()
        try:
            return socket.create_connection((host, port), timeout=max(0.05, min(left, ATTEMPT_SECONDS)))
        except OSError as exc:
            why = _reason(exc)
        if time.monotonic() >= deadline:
            raise NoStoreThere(
                f"could not reach {describe} within {connect_timeout:g} s ({why}); check --rdzv-endpoint and "
                "that the store's host is up"
            )
        if progress is not None and time.monotonic() >= next_line:
            until = time.strftime("%H:%M:%S", time.localtime(time.time() + deadline - time.monotonic()))
            progress(f"waiting for {describe} ({why}); giving up at {until}, in {deadline - time.monotonic():.0f} s")
            next_line += PROGRESS_SECONDS
        # wait: short: RETRY_SECONDS between connect attempts, up to the deadline
        time.sleep(min(RETRY_SECONDS, max(0.0, deadline - time.monotonic())))


def _reason(exc: OSError) -> str:
    if isinstance(exc, socket.gaierror):
        return "its host name does not resolve"
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused: nothing listens there yet"
    if isinstance(exc, socket.timeout):
        return "no answer to the connect"
    return exc.strerror or str(exc)


def bounded(fn: Callable[[], Any], seconds: float, what: str) -> Any:
    """`fn()` in a daemon thread: its result, or NoStoreThere when it has not returned after
    `seconds` (the thread is left behind: a torch call blocked on a silent peer cannot be cut)."""
    box: dict[str, Any] = {}
    done = threading.Event()

    def call() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # re-raised in the caller's thread
            box["error"] = exc
        done.set()

    threading.Thread(target=call, daemon=True, name="rally-store-connect").start()
    # wait: slice: the caller's bound (read_timeout)
    if not done.wait(seconds):
        raise NoStoreThere(
            f"{what} did not finish within {seconds:g} s: the store stopped answering (frozen, or its host stalled)"
        )
    if "error" in box:
        raise box["error"]
    return box.get("value")


class CallRunner:
    """One connection's calls that wait on the server, made by one long-lived daemon thread, so
    each can be given up after its bound like `bounded`'s, without a thread started per call.

    Why: a thread per call cost 0.15-0.4 ms of CPU and as much wall time per get, multi_get and
    wait (measured on 2 cores), 10-50 of them per node at a job's start. Here a call is handed to
    the runner's thread and back. A call made while the runner is busy with another thread's call
    (a long wait) gets a thread of its own (`bounded`), so no call ever waits behind another and
    every bound is its own. After a call overran its bound the runner is closed: its thread stays
    blocked with the stuck call (a torch call cannot be cut) and the caller replaces the runner
    with the connection. The thread leaves after RUNNER_IDLE_SECONDS without work, or at `close`.
    """

    def __init__(self, name: str = "rally-store-call", idle: float = RUNNER_IDLE_SECONDS) -> None:
        self._name, self._idle = name, idle
        self._lock = threading.Lock()
        self._queue: queue.SimpleQueue[tuple[Callable[[], Any], dict[str, Any], threading.Event] | None] = (
            queue.SimpleQueue()
        )
        self._thread: threading.Thread | None = None
        self._busy = False
        self._closed = False

    def call(self, fn: Callable[[], Any], seconds: float, what: str) -> Any:
        """`fn()`'s result, or NoStoreThere when it has not returned after `seconds` (see `bounded`)."""
        with self._lock:
            mine = not self._busy and not self._closed
            if mine:
                self._busy = True
                if self._thread is None:
                    self._thread = threading.Thread(target=self._serve, daemon=True, name=self._name)
                    self._thread.start()
        if not mine:
            return bounded(fn, seconds, what)
        box: dict[str, Any] = {}
        done = threading.Event()
        self._queue.put((fn, box, done))
        # wait: slice: the caller's bound (its timeout + op_timeout)
        if not done.wait(seconds):
            self.close()  # the thread stays with the stuck call; nothing more is handed to it
            raise NoStoreThere(
                f"{what} did not finish within {seconds:g} s: the store stopped answering (frozen, or its host stalled)"
            )
        with self._lock:
            self._busy = False
        if "error" in box:
            raise box["error"]
        return box.get("value")

    def close(self) -> None:
        """No more calls: the thread leaves once it is done with the one it may be making."""
        with self._lock:
            self._closed = True
        self._queue.put(None)

    def _serve(self) -> None:
        while True:
            try:
                # wait: background: the runner's thread waits for the next call, RUNNER_IDLE_SECONDS at most
                item = self._queue.get(timeout=self._idle)
            except queue.Empty:
                with self._lock:
                    if self._busy:  # a call is being handed over right now
                        continue
                    self._thread = None
                    return
            if item is None:
                return
            fn, box, done = item
            try:
                box["value"] = fn()
            except BaseException as exc:  # re-raised in the caller's thread
                box["error"] = exc
            done.set()
