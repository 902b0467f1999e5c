"""What a worker's exit means for its round (the agent's main loop asks after every wake-up).

Each exit is noted once (an event; a SIGKILL that nobody here sent is explained by the health
monitor: the OOM killer, a cgroup limit). A failure ends the round at once on a single node. In
a multi-node round it is first recorded as the job's first failure (first wins, so every node
names the same root cause) and held until the peer check (`round_threads.check_peers`) answers
whether a peer went silent meanwhile: then that node's loss is the cause, and the failure here a
consequence ("connection closed" a moment after a peer died).

Every worker's end is in events.jsonl, whichever comes first: its own exit (`worker_exited`) or the
round's end. The round can end (a node declared lost by the keep-alive watcher, another node's
failure) in the same wake-up as a worker's exit, or before a worker notices a dead peer at all (a
loaded machine); such an exit is recorded as the round ends (`round_ending`), and a worker the
agent then stopped as `worker_stopped`, with the round's end that stopped it (`round_ended`).
"""

from __future__ import annotations

import signal
from dataclasses import dataclass
from typing import Protocol

from rally.agent.base.collaborator import AgentContext, Collaborator
from rally.agent.base.event_loop import News, PeerVerdict
from rally.agent.guard.stopping import read_what_is_left
from rally.agent.observe.health import HealthMonitor, HealthSource
from rally.agent.report import failure_end
from rally.agent.rounds.threads import check_peers
from rally.agent.rounds.workers import Worker, WorkerGroup
from rally.rendezvous.protocol import Round, RoundEnd


@dataclass
class HeldFailure:
    """A worker failed in a multi-node round: the job's first failure (first-wins, maybe another
    node's), held until the peer check answers whether a node went silent meanwhile."""

    first: RoundEnd
    local: RoundEnd  # this node's failure (a worker's exit, or an exception in rally.job.run's function)
    answered: bool = False
    silent: tuple[int, float] | None = None  # (group rank, seconds silent) of a lost peer

    def answer(self, verdict: tuple[int, float] | None) -> None:
        self.answered, self.silent = True, verdict


class ExitsContext(AgentContext, Protocol):
    """What the judge of exits needs of its agent beyond every collaborator's context."""

    @property
    def group(self) -> WorkerGroup | None: ...


class WorkerExits(Collaborator):
    """The agent's judge of its workers' exits, for the whole job (it asked for the peer check's
    answer, `PeerVerdict` news, which the agent routes to it: `on_news`)."""

    wants = (PeerVerdict,)

    def __init__(self, ctx: ExitsContext, health: HealthSource):
        """`health`: who keeps this round's health monitor (the observer)."""
        self.ctx = ctx
        self.health = health
        self.loop = ctx.loop
        self.store_call = ctx.store_call
        self.emit = ctx.events.emit
        self.kill_causes: dict[int, str] = {}  # local rank -> why its worker was SIGKILLed
        self.held: HeldFailure | None = None  # this round's local failure, until the peer check answers
        self.noted: set[int] = set()  # pids whose end is in events.jsonl (this round)
        self.ending: list[Worker] = []  # the round's workers, from its end until they are stopped
        self.ending_round = 0  # the round of `ending`

    # ------------------------------------------------------------ hooks (agent/base/collaborator.py)
    def round_formed(self, rnd: Round) -> None:
        self.held, self.noted = None, set()

    def round_ending(self, rnd: Round) -> None:
        """A worker that exited on its own but was never judged (the news of the round's end came in
        the same wake-up, or first) is recorded now, as its own exit: nothing stopped it."""
        group = self.ctx.group
        self.ending = list(group.workers) if group is not None else []
        self.ending_round = rnd.assignment.round
        for worker in self.ending:
            # wait: not_a_wait: WNOHANG (reaps an exit the event loop has not handled yet)
            if worker.process.poll() is not None and worker.pid not in self.noted:
                self._note(rnd, worker, self.health.health)

    def round_ended(self, rnd: Round, end: RoundEnd) -> None:
        """The round's workers are stopped: each one the agent stopped is recorded, with why."""
        self._stopped(rnd.assignment.round, end.detail)

    def exit(self) -> str | None:
        """A feature before this one left at `round_ended` (a quarantined node): its stops too."""
        if self.ending:
            self._stopped(self.ending_round, "the agent exits")
        return None

    def _stopped(self, round_: int, reason: str) -> None:
        ending, self.ending = self.ending, []
        for worker in ending:
            if worker.returncode is None or worker.pid in self.noted:
                continue  # parked for an in-process restart, or its exit is recorded
            self.noted.add(worker.pid)
            self.emit(
                "worker_stopped",
                round=round_,
                rank=worker.global_rank,
                pid=worker.pid,
                exit=worker.describe_exit(),
                returncode=worker.returncode,
                duration=round(worker.duration(), 3),
                reason=reason,
            )

    def watch(self, rnd: Round) -> RoundEnd | None:
        group = self.ctx.group
        assert group is not None  # the watch loop runs while the round's workers do
        return self.check(rnd, group, self.health.health)

    def on_news(self, rnd: Round, news: News) -> None:
        if isinstance(news, PeerVerdict):
            self.peer_verdict(news.lost_peer)

    def peer_verdict(self, verdict: tuple[int, float] | None) -> None:
        """The peer check's answer: (group rank, seconds silent) of a lost peer, or None."""
        if self.held is not None:
            self.held.answer(verdict)

    def check(self, rnd: Round, group: WorkerGroup, health: HealthMonitor) -> RoundEnd | None:
        """Note new exits; the round's end once a local failure decides it, else None."""
        a = rnd.assignment
        for worker in group.workers:
            if worker.returncode is not None and worker.local_rank in health.watched:
                self._note(rnd, worker, health)
        failed = [w for w in group.workers if w.returncode is not None and not w.succeeded]
        if failed:
            first = min(failed, key=lambda w: w.process.ended_at or 0)
            read_what_is_left(first.output.streams, self.loop)  # its last words, without waiting
            end = failure_end(first, a, self.kill_causes.get(first.local_rank))
            if a.group_world_size == 1:
                return self.store_call(lambda: rnd.channel.end(end))
            if self.held is None:
                self.hold(rnd, end)
                return None
        held = self.held
        if held is None or not held.answered:
            return None
        return self._end(rnd, held.first, held.silent, held.local)

    def hold(self, rnd: Round, local: RoundEnd) -> None:
        """A local failure in a multi-node round: record it as the job's first failure (unless one
        is), and ask the peer check whether a node went silent; `check` ends the round once it
        answers. The agent holds an exception of rally.job.run's function that says a peer's
        connection was lost here too: a node lost is its cause, not the rank that raised it."""
        if self.held is None:
            self.held = HeldFailure(self.store_call(lambda: rnd.channel.first_failure(local)), local)
            check_peers(self.loop.inbox.post, rnd)

    def _note(self, rnd: Round, worker: Worker, health: HealthMonitor) -> None:
        """Record a worker's exit once; explain a SIGKILL that nobody here sent."""
        if worker.returncode == -signal.SIGKILL and not worker.stopped:
            cause = health.explain_kill(worker.local_rank)
            if cause:
                self.kill_causes[worker.local_rank] = cause
        health.forget(worker.local_rank)
        self.noted.add(worker.pid)
        self.emit(
            "worker_exited",
            round=rnd.assignment.round,
            rank=worker.global_rank,
            pid=worker.pid,
            exit=worker.describe_exit(),
            returncode=worker.returncode,
            duration=round(worker.duration(), 3),
            cause=self.kill_causes.get(worker.local_rank),
        )

    def _end(self, rnd: Round, first: RoundEnd, silent: tuple[int, float] | None, local: RoundEnd) -> RoundEnd:
        """The job-wide first failure ends the round, unless a peer went silent: then that node's loss is the cause."""
        if silent is None:
            return self.store_call(lambda: rnd.channel.end(first))
        group_rank, silent_for = silent
        host = rnd.assignment.watch_host if group_rank == rnd.assignment.watch_rank else ""
        note = f"; {local.detail} after it (a consequence)"
        return self.store_call(lambda: rnd.channel.declare_lost(group_rank, host, silent_for, note))
