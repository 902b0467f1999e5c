"""--warm-spares: this node's spare processes, each of which ran the script up to `rally.job.run` and
waits there, so that a dead rank's place is taken without paying the script's set-up again
(docs/restartable.md).

Spares are started in the background once a round's workers run (the round never waits for them),
one taken at each re-entry that has a dead rank to replace (agent/rounds/parking.py), refilled
after, and stopped when the agent exits. A spare is a worker of its own log directory (a local rank
past the node's last), its output prefixed `[spare] ` until it takes a rank.
"""

from __future__ import annotations

import signal
from collections.abc import Callable
from typing import Protocol

from rally.agent.base.collaborator import AgentContext
from rally.agent.base.reentry_wire import SPARE_ENV
from rally.agent.guard.client import GuardClient
from rally.agent.guard.stopping import stop_workers
from rally.agent.rounds.output import OutputStream
from rally.agent.rounds.workers import Worker, WorkerGroup
from rally.rendezvous.protocol import Assignment


class SparesContext(AgentContext, Protocol):
    """What the warm spares need of their agent beyond every collaborator's context."""

    @property
    def guard(self) -> GuardClient | None:
        """The orphan guard, which learns every worker's process group (None before the agent runs)."""

    def launch(
        self, assignment: Assignment, master: tuple[str, int], local_ranks: set[int] | None = None, **extra: str
    ) -> WorkerGroup:
        """Start workers for `local_ranks` (all of the node's by default) as the agent starts its own
        (from the worker template, with the features' environment, `extra` on top)."""

    def helper_pids(self) -> frozenset[int]:
        """The agent's helper processes: never stopped as the job's."""


class WarmSpares:
    """This node's warm spares: started, handed out to take a dead rank's place, stopped."""

    def __init__(self, ctx: SparesContext, linked: Callable[[int], bool]) -> None:
        """`linked(pid)`: the process is inside `rally.job.run`, connected to the agent (it can be promoted)."""
        self.ctx = ctx
        self.linked = linked
        self.spares: list[Worker] = []  # processes waiting in rally.job.run for a rank's place
        self.started = 0
        self.streams: list[OutputStream] = []

    def refill(self, assignment: Assignment, master: tuple[str, int]) -> None:
        """--warm-spares: start spares until N live ones wait (each runs the script up to rally.job.run,
        in the background: the round does not wait for them)."""
        ctx = self.ctx
        self.spares = [s for s in self.spares if s.returncode is None]
        while len(self.spares) < ctx.spec.warm_spares:
            place = ctx.spec.nproc_per_node + self.started  # its own log directory, never a rank's
            self.started += 1
            spare = ctx.launch(assignment, master, {place}, **{SPARE_ENV: "1"})
            for stream in spare.streams:
                stream.prefix = b"[spare] " if stream.prefix else b""
                ctx.loop.watch_stream(stream)
            for worker in spare.workers:
                ctx.loop.watch_exit(worker)
                if ctx.guard is not None:
                    ctx.guard.guard_group(worker.pid)
                ctx.events.emit("spare_started", round=assignment.round, pid=worker.pid)
            self.spares.extend(spare.workers)
            self.streams.extend(spare.streams)
            if not spare.workers:
                break  # never loop on a start that started nothing

    def promote(self, local_rank: int) -> Worker | None:
        """A live spare inside rally.job.run takes `local_rank`'s place, or None when none is ready.
        Its output streams are then the round's, no longer the spares'."""
        for spare in self.spares:
            if spare.returncode is None and self.linked(spare.pid):
                self.spares.remove(spare)
                spare.local_rank = local_rank
                ours = {id(s) for s in spare.output.streams}
                self.streams = [s for s in self.streams if id(s) not in ours]
                return spare
        return None

    def stop(self) -> None:
        spares = [s for s in self.spares if s.returncode is None]
        if spares:
            group = WorkerGroup(workers=spares, streams=self.streams)
            stop_workers(group, signal.SIGTERM, 5.0, self.ctx.loop, self.ctx.guard, self.ctx.helper_pids(), ())
        self.spares = []
