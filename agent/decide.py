"""What happens after a round: a pure function of how the round ended, this node's place in it
and the job's restart budget. The agent (`Agent._after_round`) applies the decision: it closes
the job, prints, waits at the exit barrier; nothing here touches a process or the store, so the
whole table is tested without either (tests/test_decide.py).

    succeeded                          -> Exit(0)
    worker failed / hung, budget left  -> Restart(n + 1)       (spends the job-wide budget)
    worker failed / hung, none left    -> Exit(the failure's exit status), gave_up
    preempted                          -> Exit(75)            (EX_TEMPFAIL: requeue, retry later)
    aborted (crash loop, closed job)   -> Exit(its exit status)
    node lost / left / joined          -> Reform()            (free: membership is not a failure)
"""

from __future__ import annotations

from dataclasses import dataclass

from rally.agent.base.exit_codes import EXIT_PREEMPTED
from rally.rendezvous.base.records import Assignment, EndKind, RoundEnd


@dataclass(frozen=True)
class Restart:
    """Start the next round with every worker restarted; `restart_count` is the new count."""

    restart_count: int


@dataclass(frozen=True)
class Reform:
    """Membership changed: form the next round without spending a restart."""


@dataclass(frozen=True)
class Exit:
    """The job is over for this node: exit with `code`. `gave_up`: a failure with no restarts
    left (the agent closes the job for every node as aborted, "restarts exhausted")."""

    code: int
    gave_up: bool = False


Decision = Restart | Reform | Exit


def exit_status(end: RoundEnd) -> int:
    """The exit code a failed or aborted round asks for (never 0: the job did not succeed)."""
    return int(end.info.get("exit_status", 1)) or 1


def decide(end: RoundEnd, assignment: Assignment, max_restarts: int) -> Decision:
    """What this node does after round `a.round` ended with `end` (see the module docstring)."""
    if end.kind is EndKind.SUCCEEDED:
        return Exit(0)
    if end.is_failure:
        if assignment.restart_count + 1 > max_restarts:
            return Exit(exit_status(end), gave_up=True)
        return Restart(assignment.restart_count + 1)
    if end.kind is EndKind.PREEMPTED:
        return Exit(EXIT_PREEMPTED)
    if end.kind is EndKind.ABORTED:
        return Exit(exit_status(end))
    return Reform()
