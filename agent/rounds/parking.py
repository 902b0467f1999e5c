"""An in-process restart on this node: its workers parked in `rally.job.run` as a round ends, and
re-entered into their training function in the next round (docs/restartable.md).

Parking asks every worker to leave the function and tear torch.distributed down, staying alive;
one that does not is killed and its rank replaced at the re-entry, by a warm spare
(agent/rounds/warm_spares.py) or a new process. The re-entry gives each surviving worker what a
fresh worker of the new round would get (its environment) through the agent's line to the workers
(`ReentryLine`, agent/rounds/reentry.py's InProcessRestarts). The agent keeps the decision (a
restart or a re-form parks; anything else stops the workers) and asks through `WorkerReentry`
(agent/base/collaborator.py).
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from typing import Protocol

from rally.agent.base.event_loop import StoreLost, WorkerSaid
from rally.agent.display import console
from rally.agent.guard import processes
from rally.agent.rounds.warm_spares import SparesContext, WarmSpares
from rally.agent.rounds.workers import Worker, WorkerGroup, worker_env
from rally.rendezvous.protocol import Assignment, Round

# How long the agent waits for every worker to leave the function and tear torch.distributed
# down before it restarts them whole (a worker stuck in C code that never returns to Python).
PARK_SECONDS = 10.0
# After the round's culprit was killed for not leaving, the ranks its death released have this long.
PARK_GRACE_SECONDS = 2.0
# In a job of several nodes, how long a node whose workers parked waits for every other node's word
# that it re-enters its own too: their parking's bound, with its kills' waits, and a margin.
AGREE_SECONDS = PARK_SECONDS + PARK_GRACE_SECONDS + 2 * processes.KILL_WAIT_SECONDS + 5.0


class ReentryLine(Protocol):
    """The agent's line to its workers inside `rally.job.run` and the rule for when a failure may be
    recovered in-process (agent/rounds/reentry.py's InProcessRestarts is one)."""

    def linked(self, pid: int) -> bool:
        """Worker `pid` is inside `rally.job.run`, connected (it can be re-entered)."""

    def send(self, pid: int, op: str, **fields: object) -> bool:
        """Say `op` (agent/base/reentry_wire.py: abort, enter) to worker `pid`; False when it is not linked."""

    def refusal(self, checkpoint_step: int | None) -> str | None:
        """Why the next restart must restart the processes instead, or None when it may be in-process."""

    def spent(self, checkpoint_step: int | None) -> None:
        """An in-process restart was made (it counts toward the next refusal)."""


class ParkingContext(SparesContext, Protocol):
    """What parking and re-entering need of their agent beyond the warm spares' context."""

    @property
    def group(self) -> WorkerGroup | None:
        """This round's workers on this node, None while none run."""

    def watch_started(self, assignment: Assignment, group: WorkerGroup) -> None:
        """Watch new workers' output and exits, as the agent watches every worker it starts."""

    def workers_env(self) -> dict[str, str]:
        """The environment a worker starts from: the agent's, with every feature's variables."""


class WorkerParking:
    """Parks this node's workers at a round's end and re-enters them in the next round."""

    def __init__(self, ctx: ParkingContext, line: ReentryLine, spares: WarmSpares) -> None:
        self.ctx = ctx
        self.line = line
        self.spares = spares

    def park(self, rnd: Round, culprit: object = None) -> bool:
        """Every worker of this node leaves its training function and tears torch.distributed down,
        staying alive in rally.job.run for the next round (docs/restartable.md). False, with one line
        when the script uses job.run, when the workers must be restarted whole instead: a live rank
        not inside job.run, the re-entry budget spent, a worker whose teardown failed (its state is
        in doubt), none left, or another node that restarts its workers (`_told`): one node's whole
        restart is every node's."""
        group, a = self.ctx.group, rnd.assignment
        if group is None or not any(self.line.linked(w.pid) for w in group.workers):
            self._tell(rnd, "no worker of this node is inside rally.job.run")
            return False  # a script that does not call rally.job.run: whole restarts, as always
        why = self._reentry_refusal(group)
        started, replaced = time.monotonic(), 0
        if why is None:
            why, replaced = self._leave(rnd, group, culprit)
        if why is not None:
            self._tell(rnd, why)
        else:
            why = self._told(rnd)
            if why is None:
                seconds = round(time.monotonic() - started, 6)
                self.ctx.events.emit("workers_parked", round=a.round, seconds=seconds, replaced=replaced)
                self.line.spent(self._saved_step())
                return True
        console.say(f"restarting the worker processes instead of re-entering them: {why}")
        self.ctx.events.emit("reentry_refused", round=a.round, reason=why)
        return False

    def _leave(self, rnd: Round, group: WorkerGroup, culprit: object) -> tuple[str | None, int]:
        """Abort every worker and wait for each to park. One that does not within PARK_SECONDS is
        killed (the round's culprit first: its peers blocked on it are released when its
        connections close, and get PARK_GRACE_SECONDS more) and replaced at the re-entry. (why the
        workers must be restarted whole instead, or None; how many were killed to be replaced)."""
        started = time.monotonic()
        for worker in group.running():
            self.line.send(worker.pid, "abort", round=rnd.assignment.round)
        # wait: short: PARK_SECONDS (10), or PARK_GRACE_SECONDS (2) after the culprit's kill
        unparked, doubt = self._wait_parked(group.running(), started + PARK_SECONDS)
        first = [(w, late) for w, late in unparked if w.global_rank == culprit]
        if doubt is None and first and len(unparked) > 1:  # the hung culprit holds the others in a collective
            worker, reason = first[0]
            console.say(f"rank {worker.global_rank} {reason}: killing it; a new process takes its place")
            _kill_worker(worker)
            late = [w for w, _ in unparked if w is not worker and w.returncode is None]
            # wait: short: PARK_SECONDS (10), or PARK_GRACE_SECONDS (2) after the culprit's kill
            unparked, doubt = self._wait_parked(late, time.monotonic() + PARK_GRACE_SECONDS)
        if doubt is not None:
            return doubt, 0  # every worker is stopped and restarted: none is killed alone
        for worker, reason in unparked:
            console.say(f"rank {worker.global_rank} {reason}: killing it; a new process takes its place")
            _kill_worker(worker)
        if not any(w.returncode is None for w in group.workers):
            return "no worker of this node is left to re-enter", len(unparked)
        return None, len(unparked)

    def _tell(self, rnd: Round, why: str) -> None:
        """In a job of several nodes, the others learn that this node restarts its workers, and why."""
        if rnd.assignment.group_world_size > 1:
            self.ctx.store_call(lambda: rnd.channel.publish_reentry(why))

    def _told(self, rnd: Round) -> str | None:
        """In a job of several nodes: this node re-enters its workers, if every other node does too.
        It says so and waits (at most AGREE_SECONDS) for the others' word; why another restarts its
        workers (a rank of its in doubt had a process group with ranks of every node; its budget
        spent) is why this one does too, so the restart is whole for every node or for none."""
        if rnd.assignment.group_world_size == 1:
            return None
        self.ctx.store_call(lambda: rnd.channel.publish_reentry(None))
        other = self.ctx.store_call(lambda: rnd.channel.reentry_refusal(AGREE_SECONDS), waiting=True)
        if other is None:
            return None
        g, host, why = other
        return f"node {g}{f' ({host})' if host else ''} restarts its workers: {why}"

    def _reentry_refusal(self, group: WorkerGroup) -> str | None:
        """Why this node's workers must be restarted whole; a dead worker is no reason (it is replaced)."""
        for worker in group.running():
            if not self.line.linked(worker.pid):
                return f"rank {worker.global_rank} (pid {worker.pid}) is not inside rally.job.run"
        return self.line.refusal(self._saved_step())

    def _wait_parked(self, workers: list[Worker], deadline: float) -> tuple[list[tuple[Worker, str]], str | None]:
        """Until each of `workers` said "parked" or the deadline: those still inside the function,
        with why; and, as soon as one says its teardown failed, why its state is in doubt (then
        nothing else matters: every worker is restarted whole)."""
        loop = self.ctx.loop
        waiting = {w.pid: w for w in workers}
        kept: list = []
        try:
            while waiting:
                now = time.monotonic()
                if now >= deadline:
                    late = f"did not leave the training function within {PARK_SECONDS:g} s"
                    return [(worker, late) for worker in waiting.values()], None
                loop.pump(deadline - now)
                for news in loop.take_events():
                    match news:
                        case WorkerSaid(pid=pid, message={"op": "parked"} as said) if pid in waiting:
                            worker = waiting.pop(pid)
                            if not said.get("ok"):  # a failed NCCL abort, a sticky CUDA error, a stuck teardown
                                what = f"could not tear torch.distributed down ({said.get('why')})"
                                return [], f"rank {worker.global_rank}'s state is in doubt: it {what}"
                        case StoreLost():
                            kept.append(news)
                        case _:
                            pass  # of the round that ended (its end, a consequence of its abort)
                for pid, worker in list(waiting.items()):
                    if worker.returncode is not None:  # died while leaving: replaced like any dead rank
                        del waiting[pid]
            return [], None
        finally:
            loop.events.extend(kept)  # e.g. a lost store: the main loop acts on it next

    def reenter(self, rnd: Round, master: tuple[str, int]) -> None:
        """The parked workers enter their training function again with this round's environment
        (ranks, WORLD_SIZE, MASTER_ADDR/PORT, RALLY_ROUND, ...): what a fresh worker would get."""
        ctx, group, assignment = self.ctx, self.ctx.group, rnd.assignment
        assert group is not None  # only parked workers are re-entered
        ctx.events.emit("workers_starting", round=assignment.round, in_process=True)
        env = ctx.workers_env()
        dead = {w.local_rank for w in group.workers if w.returncode is not None}
        promoted: list[Worker] = []
        for local_rank in sorted(dead):  # a warm spare takes the place: it ran the script up to job.run
            spare = self.spares.promote(local_rank)
            if spare is not None:
                group.replace(WorkerGroup(workers=[spare], streams=list(spare.output.streams)))
                promoted.append(spare)
                dead.discard(local_rank)
                ctx.events.emit("spare_promoted", round=assignment.round, local_rank=local_rank, pid=spare.pid)
        if dead:  # no spare: a new process runs the script up to job.run and joins
            fresh = ctx.launch(assignment, master, dead)
            group.replace(fresh)
            ctx.watch_started(assignment, fresh)
        for worker in group.workers:
            if worker.local_rank in dead:
                continue
            worker.global_rank = assignment.rank_offset + worker.local_rank
            worker_vars = worker_env(ctx.spec, env, assignment, master, worker.local_rank, worker.error_file)
            if worker.heartbeat_file:
                worker_vars["RALLY_HEARTBEAT_FILE"] = worker.heartbeat_file
            self.line.send(worker.pid, "enter", round=assignment.round, env=worker_vars)
            rank, local_rank = worker.global_rank, worker.local_rank
            ctx.events.emit(
                "worker_reentered", round=assignment.round, rank=rank, local_rank=local_rank, pid=worker.pid
            )
            if any(worker is spare for spare in promoted):  # its output now carries its rank
                for stream in worker.output.streams:
                    stream.prefix = f"[{rank}] ".encode() if stream.prefix else b""

    def _saved_step(self) -> int | None:
        """The newest step saved this job (the checkpoint feature's status field), for the re-entry budget."""
        record = self.ctx.status_now() or {}
        step = record.get("checkpoint_saved_step")
        return step if isinstance(step, int) else None


def _kill_worker(worker: Worker) -> None:
    """SIGKILL a worker that cannot be re-entered (its process group: what it started goes too)."""
    worker.stopped = True
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(worker.pid, signal.SIGKILL)
    # wait: short: KILL_WAIT_SECONDS (5) after the SIGKILL above
    worker.process.wait(timeout=processes.KILL_WAIT_SECONDS)
