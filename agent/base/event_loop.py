"""Everything the agent waits for, on file descriptors watched by one selector in its main thread.

Worker exits arrive on pidfds (readable the moment a worker exits), worker output on its pipes,
signals on the wake-up fd (the handlers only write the signal's number, see
`signal.set_wakeup_fd`), and whatever the agent's threads learn through the inbox, a pipe they
write to. `pump(timeout)` waits for the next of these and files it; nothing polls. What a signal
*means* is not decided here but by the agent's state (agent/base/states.py).
"""

from __future__ import annotations

import os
import queue
import selectors
import signal
import threading
from collections.abc import Callable
from enum import Enum
from typing import Any


class Event(str, Enum):
    """What the agent's threads post to its inbox, and the value that comes with each."""

    ROUND_END = "round_end"  # (round, RoundEnd): the round's end key was set (round_threads.py)
    PEER_VERDICT = "peer_verdict"  # (round, (group rank, silent s) | None): after a local failure
    STORE_LOST = "store_lost"  # StoreError: a thread lost the store, or the store went silent
    DUMP_STACKS = "dump_stacks"  # round: another node asks for this node's stacks (hang_report.py)
    WAKE = "wake"  # a call run by `run_blocking` has returned


class Inbox:
    """Events from threads, delivered to the main loop through a pipe it selects on."""

    def __init__(self) -> None:
        self.read_fd, self.write_fd = os.pipe()
        os.set_blocking(self.read_fd, False)
        os.set_blocking(self.write_fd, False)
        self.items: queue.SimpleQueue[tuple[Event, Any]] = queue.SimpleQueue()

    def post(self, kind: Event, value: Any = None) -> None:
        self.items.put((kind, value))
        try:
            os.write(self.write_fd, b"x")
        except BlockingIOError:
            pass  # the pipe is full: the main loop wakes anyway

    def drain(self) -> list[tuple[Event, Any]]:
        try:
            while os.read(self.read_fd, 4096):
                pass
        except BlockingIOError:
            pass
        out = []
        while not self.items.empty():
            out.append(self.items.get_nowait())
        return out


class EventLoop:
    """The agent's selector, its pending signals and its pending inbox events."""

    def __init__(self, on_worker_exit: Callable[[Any], None], on_child_signal: Callable[[], None]):
        """`on_worker_exit(worker)` runs when a worker's pidfd turns readable; `on_child_signal()`
        on SIGCHLD (an orphan re-parented to the agent may have exited: reap it)."""
        self.on_worker_exit = on_worker_exit
        self.on_child_signal = on_child_signal
        self.selector = selectors.DefaultSelector()
        self.inbox = Inbox()
        self.selector.register(self.inbox.read_fd, selectors.EVENT_READ, ("inbox", None))
        self.signal_r, self.signal_w = os.pipe()
        os.set_blocking(self.signal_r, False)
        os.set_blocking(self.signal_w, False)
        self.selector.register(self.signal_r, selectors.EVENT_READ, ("signal", None))
        self.signals: list[int] = []
        self.events: list[tuple[Event, Any]] = []

    def install_signal_handlers(self, handled: set[int]) -> None:
        signal.set_wakeup_fd(self.signal_w, warn_on_full_buffer=False)
        for signum in (*handled, signal.SIGCHLD):
            signal.signal(signum, lambda *_: None)  # the wake-up fd carries the number
        signal.siginterrupt(signal.SIGCHLD, False)  # threads' blocking calls restart, not fail
        # The launcher blocks the preemption signals until now (see launcher.cli.main); a signal
        # that arrived meanwhile is delivered here, to the handler just installed.
        signal.pthread_sigmask(signal.SIG_UNBLOCK, handled | {signal.SIGUSR1, signal.SIGUSR2})

    # ---------------------------------------------------------------- what is watched
    def watch_stream(self, stream: Any) -> None:
        self.selector.register(stream.fd, selectors.EVENT_READ, ("stream", stream))

    def watch_exit(self, worker: Any) -> None:
        self.selector.register(worker.process.pidfd, selectors.EVENT_READ, ("exit", worker))

    def unwatch(self, fd: int) -> None:
        try:
            self.selector.unregister(fd)
        except (KeyError, ValueError):
            pass

    def unwatch_workers(self) -> None:
        for key in list(self.selector.get_map().values()):
            if key.data[0] in ("stream", "exit"):
                self.selector.unregister(key.fd)

    # ---------------------------------------------------------------- waiting
    def pump(self, timeout: float | None) -> None:
        """Wait up to `timeout` for I/O and handle it: worker exits and output, signals, events."""
        # wait: slice, said by the job: the agent's one select: the running job's exits, output and signals
        for key, _ in self.selector.select(timeout):
            kind, obj = key.data
            if kind == "stream":
                if not obj.on_readable():
                    self.selector.unregister(key.fd)
            elif kind == "exit":
                self.on_worker_exit(obj)
                # wait: not_a_wait: reaps an exited worker
                obj.process.poll()
                self.selector.unregister(key.fd)
            elif kind == "signal":
                try:
                    data = os.read(self.signal_r, 64)
                except BlockingIOError:
                    data = b""
                if signal.SIGCHLD in data:
                    self.on_child_signal()
                self.signals.extend(s for s in data if s != signal.SIGCHLD)
            elif kind == "inbox":
                self.events.extend(self.inbox.drain())

    def take_signals(self) -> list[int]:
        out, self.signals = self.signals, []
        return out

    def keep_signals(self, signums: list[int]) -> None:
        """Put signals back, in front, for whoever handles them next (none is ever dropped)."""
        self.signals[:0] = signums

    def take_events(self) -> list[tuple[Event, Any]]:
        out, self.events = self.events, []
        return out

    def run_blocking(self, fn: Callable[[], Any], between: Callable[[], None], interval: float | None) -> Any:
        """Run a blocking call in a thread while this loop keeps handling I/O; `between()` runs
        after every wake-up (at least every `interval` s) and may raise to give up waiting."""
        box: dict[str, Any] = {}
        done = threading.Event()

        def call() -> None:
            try:
                box["value"] = fn()
            except BaseException as exc:  # re-raised in the main thread
                box["error"] = exc
            done.set()
            self.inbox.post(Event.WAKE)

        threading.Thread(target=call, daemon=True).start()
        while not done.is_set():
            self.pump(interval)
            between()
        self.events = [e for e in self.events if e[0] is not Event.WAKE]
        if "error" in box:
            raise box["error"]
        return box.get("value")
