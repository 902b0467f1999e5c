"""Preemption: the scheduler warned that the job will be killed; checkpoint, stop, requeue.

The warning signal (SLURM's `--signal=USR1@90`, say) is forwarded to every worker; rally's
bootstrap turns it into `rally.job.preempted()` instead of a kill. The workers get up to
`--preemption-grace` seconds to save and exit. Node 0 asks the scheduler to requeue the job
(`--requeue`) only once every node's workers are done or the grace is over, because a requeue
makes SLURM kill every task and a shard still being saved would be lost. The round then ends as
"preempted", so every node stops with EXIT_PREEMPTED (75, EX_TEMPFAIL: retry later).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol

from rally.agent.base.collaborator import AgentContext, Collaborator
from rally.agent.base.exit_codes import EXIT_PREEMPTED
from rally.agent.base.states import AgentState, SignalAction, signal_action
from rally.agent.display import console
from rally.agent.guard import processes
from rally.agent.rounds.workers import WorkerGroup
from rally.rendezvous.protocol import EndKind, Round, RoundEnd
from rally.rendezvous.status.long_wait import LongWait, wait_in_slices


class PreemptionContext(AgentContext, Protocol):
    @property
    def group(self) -> WorkerGroup | None:
        """This round's workers on this node, None while none run."""


class Preemption(Collaborator):
    """This node's part in a preemption (its hook `on_preemption` runs when the agent's state says a
    signal preempts); `requeue()`, when given, asks the scheduler to requeue."""

    def __init__(self, ctx: PreemptionContext, requeue: Callable[[], str] | None):
        self.ctx = ctx
        self.spec = ctx.spec
        self.host = ctx.host
        self.preferred_rank = ctx.node.preferred_rank
        self.loop = ctx.loop
        self.store_call = ctx.store_call
        self.requeue = requeue

    def on_preemption(self, rnd: Round | None, signum: int) -> RoundEnd | None:
        """In a round: run it (the round's end); without one the agent exits preempted: requeue."""
        if rnd is None:
            self.requeue_once(None)
            return None
        return self.run(rnd, signum)

    def run(self, rnd: Round, signum: int) -> RoundEnd:
        """Warn the workers, wait for their checkpoints (bounded), requeue, end the round."""
        group = self.ctx.group
        name = processes.signal_name(signum)
        grace = self.spec.preemption_grace
        console.say(
            f"received {name} (preemption or time limit): forwarding it to the workers; up to {grace:g} s to checkpoint"
        )
        for worker in group.running() if group else []:
            processes.send_to_group(worker.pid, signum)
        # In slices, so that a long grace says every few seconds who is still saving.
        workers = LongWait(f"after {name}: waiting for this node's workers to checkpoint and exit", grace, console.say)
        while group and group.running() and workers.left() > 0:
            self.loop.pump(workers.slice())
            actions = [
                signal_action(AgentState.PREEMPTING, s, self.spec.preemption_signals) for s in self.loop.take_signals()
            ]
            if SignalAction.END_GRACE in actions:
                break
            workers.what = (
                f"after {name}: waiting for {len(group.running())} worker(s) of this node to checkpoint and exit"
            )
            workers.tick()
        # wait: slice, said by Preemption.run: --preemption-grace
        self._wait_for_all_nodes(rnd, workers.deadline)
        self.requeue_once(rnd)
        end = RoundEnd(EndKind.PREEMPTED, f"{self.host} received {name}", self.host, {"exit_status": EXIT_PREEMPTED})
        return self.store_call(lambda: rnd.channel.end(end))

    def _wait_for_all_nodes(self, rnd: Round, deadline: float) -> None:
        self.store_call(rnd.preemption.note_checkpointed)
        if rnd.assignment.group_rank == 0 and self.spec.requeue:
            remaining = max(0.01, deadline - time.monotonic())
            what = "waiting for every node's workers to checkpoint before requeueing (--preemption-grace)"
            if not self.store_call(
                # wait: bounded, said by Preemption._wait_for_all_nodes: what is left of --preemption-grace, in slices
                #   with a line every few seconds, through store_call
                lambda: wait_in_slices(rnd.preemption.wait_all_checkpointed, remaining, what, console.say)
            ):
                console.warn("not every node finished checkpointing within --preemption-grace; requeueing anyway")

    def requeue_once(self, rnd: Round | None) -> None:
        """Node 0 asks the scheduler to requeue the job, once per job, when --requeue is on.
        Without a round (a warning while waiting for one) node 0 is the preferred rank 0."""
        if not self.spec.requeue or self.requeue is None:
            return
        a = rnd.assignment if rnd is not None else None
        if a is not None and a.group_rank != 0:
            return
        if a is None and self.preferred_rank not in (0, None):
            return
        if rnd is not None and not self.store_call(rnd.preemption.claim_requeue):
            return
        try:
            console.say(self.requeue())
        except Exception as exc:  # a failed requeue is reported, not fatal
            console.error(f"could not requeue the job: {exc}")
