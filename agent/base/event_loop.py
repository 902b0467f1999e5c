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
from dataclasses import dataclass
from typing import Any, Protocol

from rally.rendezvous.base.records import RoundEnd


@dataclass(frozen=True)
class RoundEnded:
    """The round's end key was set (agent/rounds/threads.py's end watcher)."""

    round: int
    end: RoundEnd


@dataclass(frozen=True)
class PeerVerdict:
    """The peer check's answer after a local failure: (group rank, seconds silent) of a lost peer, or None."""

    round: int
    lost_peer: tuple[int, float] | None


@dataclass(frozen=True)
class StoreLost:
    """A thread lost the store, or the store went silent."""

    error: BaseException


@dataclass(frozen=True)
class DumpStacks:
    """Another node asks for this node's stacks (agent/observe/hang_report.py): request `request` of the round."""

    round: int
    request: int = 0


@dataclass(frozen=True)
class WorkerSaid:
    """A worker inside `rally.job.run` sent a message (agent/rounds/reentry.py): `pid` from the kernel."""

    pid: int
    message: dict


@dataclass(frozen=True)
class PeersDone:
    """Every other node's ranks are done (agent/observe/exit_watch.py): `kind` "done", each exited 0
    or returned from its rally.job.run function; "succeeded", each exited 0."""

    round: int
    kind: str


@dataclass(frozen=True)
class Wake:
    """A call run by `EventLoop.run_blocking` has returned."""


# What the agent's threads post to its inbox: each kind a type with named fields, so the main
# loop matches on them (agent/agent.py `_on_events`) instead of reading positions of a tuple.
News = RoundEnded | PeerVerdict | StoreLost | DumpStacks | WorkerSaid | PeersDone | Wake
Post = Callable[[News], None]


class ReadableStream(Protocol):
    """A worker's pipe as the loop sees it (agent/rounds/output.py's OutputStream is one)."""

    @property
    def fd(self) -> int: ...

    def on_readable(self) -> bool:
        """Move what is available; False once the writer closed the pipe."""


class ExitingProcess(Protocol):
    @property
    def pidfd(self) -> int: ...

    def poll(self) -> int | None: ...


class ExitWatched(Protocol):
    """A worker whose exit the loop watches (agent/rounds/workers.py's Worker is one)."""

    @property
    def process(self) -> ExitingProcess: ...


class Inbox:
    """Events from threads, delivered to the main loop through a pipe it selects on."""

    def __init__(self) -> None:
        self.read_fd, self.write_fd = os.pipe()
        os.set_blocking(self.read_fd, False)
        os.set_blocking(self.write_fd, False)
        self.items: queue.SimpleQueue[News] = queue.SimpleQueue()

    def post(self, news: News) -> None:
        self.items.put(news)
        try:
            os.write(self.write_fd, b"x")
        except BlockingIOError:
            pass  # the pipe is full: the main loop wakes anyway

    def drain(self) -> list[News]:
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
        self.events: list[News] = []

    def install_signal_handlers(self, handled: set[int]) -> None:
        signal.set_wakeup_fd(self.signal_w, warn_on_full_buffer=False)
        for signum in (*handled, signal.SIGCHLD):
            signal.signal(signum, lambda *_: None)  # the wake-up fd carries the number
        signal.siginterrupt(signal.SIGCHLD, False)  # threads' blocking calls restart, not fail
        # The launcher blocks the preemption signals until now (see launcher.cli.main); a signal
        # that arrived meanwhile is delivered here, to the handler just installed.
        signal.pthread_sigmask(signal.SIG_UNBLOCK, handled | {signal.SIGUSR1, signal.SIGUSR2})

    # ---------------------------------------------------------------- what is watched
    def watch_stream(self, stream: ReadableStream) -> None:
        self.selector.register(stream.fd, selectors.EVENT_READ, ("stream", stream))

    def watch_exit(self, worker: ExitWatched) -> None:
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

    def take_events(self) -> list[News]:
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
            self.inbox.post(Wake())

        threading.Thread(target=call, daemon=True).start()
        while not done.is_set():
            self.pump(interval)
            between()
        self.events = [e for e in self.events if not isinstance(e, Wake)]
        if "error" in box:
            raise box["error"]
        return box.get("value")
