"""Background calls made again and again in one process (each re-entry of `rally.job.run`: its
teardown, its resume prefetch) run in threads kept for the next call instead of a new thread per
call.

Why: every new thread takes one of glibc's malloc arenas (the one an exited thread left) and a
cached stack, and leaves its small allocations there; a few that live for good (torch's, glibc's)
then pin a page each in arenas that the other threads of later rounds allocate in. Two new threads
an entry made a worker's anonymous RSS grow by 2-9 KB an entry over 50 re-entries; kept, the
arenas and stacks each call uses stay the same ones (tests/test_inprocess_restart.py, docs/restartable.md).

A call is handed to an idle thread of its pool, or to a new one when all are busy (a call still
running, e.g. a prefetch waiting on a slow holder, never delays the next): each pool holds as many
threads as calls ever ran at once (one, in practice).
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable

_Inbox = queue.SimpleQueue[tuple[Callable[[], object], "Call"]]


class Call:
    """One call given to a pool: `join` and `is_alive` as a thread's, for the call alone."""

    def __init__(self) -> None:
        self._done = threading.Event()

    def join(self, timeout: float | None = None) -> None:
        # wait: slice, said by the job: the caller's timeout, as Thread.join's (the teardown's 10 s, the prefetch's 5 s)
        self._done.wait(timeout)

    def is_alive(self) -> bool:
        return not self._done.is_set()


class Pool:
    """Daemon threads named `name` that run the calls given to `start`, kept idle in between."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._idle: list[_Inbox] = []
        self._lock = threading.Lock()
        # a forked child has none of the parent's threads: the idle ones it would hand calls to are gone
        os.register_at_fork(after_in_child=self._forget_threads)

    def _forget_threads(self) -> None:
        self._idle, self._lock = [], threading.Lock()

    def start(self, target: Callable[[], object]) -> Call:
        """Run `target()` in an idle thread of the pool, or in a new one if none is idle."""
        call = Call()
        with self._lock:
            inbox = self._idle.pop() if self._idle else None
        if inbox is None:
            inbox = queue.SimpleQueue()
            threading.Thread(target=self._serve, args=(inbox,), name=self.name, daemon=True).start()
        inbox.put((target, call))
        return call

    def _serve(self, inbox: _Inbox) -> None:
        while True:
            target, call = inbox.get()
            try:
                target()  # an exception ends the thread, reported as a thread's is (threading.excepthook)
            finally:
                call._done.set()
            with self._lock:
                self._idle.append(inbox)
