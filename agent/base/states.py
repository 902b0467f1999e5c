"""The agent's states, and the one table that says what a signal means in each of them.

    STARTING -> RENDEZVOUS -> ROUND_SETUP -> RUNNING -+-> STOPPING -> RENDEZVOUS (next round)
                    ^                          |      |            -> EXIT_BARRIER -> exit
                    |                          |      +-> (a signal: leave the job, exit 128+n)
                    |                          +-> PREEMPTING -> STOPPING -> EXIT_BARRIER -> 75
                    +-- a spare waits here; a round that ends before it runs goes back here

A signal is only ever noted by its handler (agent/base/event_loop.py); it takes effect where the
main loop next looks, through `signal_action`. Nothing else decides what a signal does, so a
signal is never lost between rounds, never handled twice, and never means different things in
different corners of the code.
"""

from __future__ import annotations

from enum import Enum


class AgentState(Enum):
    STARTING = "starting"  # opening the store; the worker template preloads meanwhile
    RENDEZVOUS = "rendezvous"  # waiting for a round to form (or as a spare)
    ROUND_SETUP = "round setup"  # in a round: waiting for the workers' store address
    RUNNING = "running"  # workers run; the main loop watches them
    PREEMPTING = "preempting"  # workers were warned by the scheduler and are checkpointing
    STOPPING = "stopping"  # workers were signalled and have their grace period
    EXIT_BARRIER = "exit barrier"  # the job ended; the store's host waits for the others to read it

    @property
    def waiting_for(self) -> str:
        """For messages: `stopped by SIGTERM while waiting for <this>`."""
        return "the exit barrier" if self is AgentState.EXIT_BARRIER else "the rendezvous"


class SignalAction(Enum):
    PREEMPT = "preempt"  # forward to the workers, give them --preemption-grace to checkpoint,
    # end the round as preempted (every node exits 75), node 0 requeues when asked to
    LEAVE = "leave"  # forward to the workers, stop them, leave the round (the others re-form), 128+n
    EXIT_PREEMPTED = "exit preempted"  # nothing runs here: requeue when asked to, exit 75 now
    EXIT = "exit"  # nothing runs here: exit 128+n now
    END_GRACE = "end grace"  # stop waiting for checkpoints; the preemption stands
    CUT_GRACE = "cut grace"  # stop waiting out the workers' grace; handle the signal after the stop
    IGNORE = "ignore"  # a preemption warning when there is nothing left to preempt


def signal_action(
    state: AgentState, signum: int, preemption_signals: frozenset[int] | set[int] | tuple[int, ...]
) -> SignalAction:
    """What `signum` means to an agent in `state`."""
    preempt = signum in preemption_signals
    if state is AgentState.RUNNING:
        return SignalAction.PREEMPT if preempt else SignalAction.LEAVE
    if state is AgentState.PREEMPTING:
        return SignalAction.IGNORE if preempt else SignalAction.END_GRACE
    if state is AgentState.STOPPING:
        return SignalAction.CUT_GRACE
    if state is AgentState.EXIT_BARRIER:  # the job has ended: nothing left to preempt or requeue
        return SignalAction.IGNORE if preempt else SignalAction.EXIT
    return SignalAction.EXIT_PREEMPTED if preempt else SignalAction.EXIT  # STARTING, RENDEZVOUS, ROUND_SETUP
