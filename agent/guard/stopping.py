"""Stopping a round's workers: a signal to each process group, one grace period, then SIGKILL of
every descendant, and the output they left read to its end (bounded: a grandchild may hold a
pipe open for ever)."""

from __future__ import annotations

import signal
import time
from collections.abc import Sequence
from typing import Protocol

from rally.agent.base import linux
from rally.agent.base.event_loop import EventLoop, ReadableStream
from rally.agent.base.states import AgentState, SignalAction, signal_action
from rally.agent.display import console
from rally.agent.guard import processes
from rally.agent.guard.client import GuardClient


class StoppableWorker(Protocol):
    """A worker as stopping sees it (agent/rounds/workers.py's Worker is one)."""

    stopped: bool  # set here: its exit was asked for, not a failure

    @property
    def pid(self) -> int: ...

    @property
    def process(self) -> processes.ChildProcess: ...


class StoppableGroup(Protocol):
    """A round's workers as stopping sees them (agent/rounds/workers.py's WorkerGroup is one): a
    protocol, so that guard/ does not depend on the room above it that starts them."""

    @property
    def workers(self) -> Sequence[StoppableWorker]: ...

    @property
    def streams(self) -> Sequence[OutputPipe]: ...

    def running(self) -> Sequence[StoppableWorker]: ...

    def close(self) -> None: ...


class OutputPipe(ReadableStream, Protocol):
    open: bool
    last_read_at: float


# Signals whose default action ends the process: after one, the kernel lets another process free its memory.
FATAL_BY_DEFAULT = frozenset({signal.SIGTERM, signal.SIGKILL, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT})
# How long to keep reading stopped workers' pipes to their end (a grandchild may hold them open).
OUTPUT_DRAIN_SECONDS = 2.0


def stop_workers(
    group: StoppableGroup,
    signum: int,
    grace: float,
    loop: EventLoop,
    guard: GuardClient | None,
    helpers: frozenset[int],
    preemption_signals: tuple[int, ...] = (),
) -> None:
    """Signal every worker's group, keep draining output for up to `grace` s, then SIGKILL the
    whole tree (never `helpers`: the template and the orphan guard). A signal that arrives
    meanwhile means what the signal table says in STOPPING (agent/base/states.py): it cuts the
    grace short, and stays pending for the agent's next state."""
    running = group.running()
    tree = processes.snapshot_descendants([w.process for w in running])
    for worker in running:
        worker.stopped = True
        processes.stop_group(worker.pid, signum)  # with SIGCONT: a stopped worker must not sit out the grace
        if signum in FATAL_BY_DEFAULT and worker.process.pidfd >= 0:
            # Its memory freed from here too, while it frees the rest (a worker that handles the signal is refused)
            linux.release_memory_soon(worker.process.pidfd)
    deadline = time.monotonic() + grace
    pending = len(loop.signals)
    while group.running() and time.monotonic() < deadline:
        loop.pump(max(0.0, deadline - time.monotonic()))
        arrived = [signal_action(AgentState.STOPPING, s, preemption_signals) for s in loop.signals[pending:]]
        if SignalAction.CUT_GRACE in arrived:
            break
    stuck = processes.kill_all([w.process for w in group.workers], tree, helpers)
    if stuck:
        console.warn(
            f"processes {stuck} did not die within {processes.KILL_WAIT_SECONDS:g} s of SIGKILL (stuck in the kernel?)"
        )
    drain_streams(group.streams, loop, OUTPUT_DRAIN_SECONDS)
    loop.unwatch_workers()
    for worker in group.workers:
        if guard is not None:
            guard.unguard_group(worker.pid)
    group.close()


def drain_streams(streams: Sequence[OutputPipe], loop: EventLoop, seconds: float) -> None:
    """Keep reading until these pipes reach end-of-file, for at most `seconds`."""
    deadline = time.monotonic() + seconds
    while any(s.open for s in streams) and time.monotonic() < deadline:
        loop.pump(0.05)


def read_what_is_left(streams: Sequence[OutputPipe], loop: EventLoop) -> None:
    """Read whatever a dead worker left in its pipes, without waiting for end-of-file (a child
    of the worker may hold the pipe open for a long time)."""
    for stream in streams:
        while stream.open:
            before = stream.last_read_at
            if not stream.on_readable():
                loop.unwatch(stream.fd)
                break
            if stream.last_read_at == before:  # nothing more available right now
                break
