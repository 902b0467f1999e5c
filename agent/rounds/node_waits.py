"""What this node is waiting for, as the console and `rally status` show it.

A long wait of the agent's (the pre-flight probe, the worker template, node 0's workers' store)
says every few seconds what it waits for and how long it may still last (rendezvous/status/long_wait.py,
rendezvous/status/waiting.py). The line goes to the console at once; while the round runs, the
keep-alive thread republishes the node's status record every few seconds (agent/rounds/threads.py),
so the line goes into that record too (`waiting`, which `rally status` prints per node) for as
long as the wait lasts. A wait says its line once per interval: a line older than two intervals
belongs to a wait that is over, and leaves the record by itself; so does one said before the
round's first record (the wait for the round to form, which is over once there is a round).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial
from typing import Any

from rally.rendezvous.protocol import Round
from rally.rendezvous.status.long_wait import wait_in_slices
from rally.rendezvous.status.waiting import WAIT_PROGRESS_SECONDS, WaitProgress, announce_wait

# A wait's line stays in the status record this long after it was said (the next comes after one interval).
FRESH_SECONDS = 2 * WAIT_PROGRESS_SECONDS


class NodeWaits:
    """The line of this node's wait under way: `announce` it, read it back with `fields`."""

    def __init__(self, say: Callable[[str], None]) -> None:
        self.say = say
        self.last: tuple[float, str] | None = None
        self.round: tuple[int, float] | None = None  # (round, when its first record was asked for)

    def announce(self, line: str) -> None:
        """A long wait's progress line: on the console, and in this node's status record."""
        self.last = (time.monotonic(), line)
        self.say(line)

    def fields(self, round_no: int, *others: WaitProgress | None) -> dict[str, Any]:
        """{"waiting": line} for round `round_no`'s status record while a wait is under way: this node's
        own, or one the rendezvous says through `others` (its `WaitProgress`); else nothing."""
        now = time.monotonic()
        if self.round is None or self.round[0] != round_no:
            self.round = (round_no, now)
        lines = [self.last, *(o.last for o in others if o is not None)]
        fresh = [
            seen for seen in lines if seen is not None and self.round[1] <= seen[0] and now - seen[0] < FRESH_SECONDS
        ]
        return {"waiting": max(fresh)[1]} if fresh else {}


def wait_for_readers(rnd: Round, timeout: float) -> bool:
    """The store's host, before it exits, waits (up to `timeout`) for the other nodes to read the
    job's end, so none loses the store mid-read; it says so on the console and in its status
    record (through the node's `Rendezvous`: the round's threads, which republish the record,
    have stopped by now). True once all have read it."""
    r = rnd.assignment.round
    what = (
        f"round {r} ended the job: waiting for the other nodes to read that before this node, the store's host, exits"
    )
    # wait: bounded, said by wait_for_readers: the caller's timeout, in slices with a line (console and status record)
    return wait_in_slices(rnd.channel.wait_all_acknowledged, timeout, what, partial(announce_wait, rnd.rendezvous))
