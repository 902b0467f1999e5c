"""A wait that can last more than a few seconds, in slices: what it waits for and how long it may
still last, every few seconds, and never past its bound.

The rendezvous' own waits tick `waiting.WaitProgress` in their loops (rendezvous/protocol.py).
This is the same throttle for the other long waits, which are one blocking call with a bound: a
store key (rendezvous/etcd/store.py), the store's host before it exits (agent/agent.py), the
pre-flight probe (agent/checks/preflight.py), the worker template (agent/template/connection.py),
the job's last checkpoint flush (agent/checkpoint/node_checkpoints.py). The call is made in slices of at most
`WAIT_PROGRESS_SECONDS`; after each slice that did not end the wait, `tick()` says (once per
interval) `<what>: up to N s more`, or answers False once the bound is reached. Where the line
goes is the caller's `announce`: the console, and for a node's waits also its status record
(agent/rounds/node_waits.py), so `rally status` shows it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

from rally.rendezvous.status.waiting import WAIT_PROGRESS_SECONDS, WaitProgress

T = TypeVar("T")


def left_line(what: str, left: float) -> str:
    """`waiting for node 0's workers' store at host:port: up to 150 s more`."""
    return f"{what}: up to {max(left, 0.0):.0f} s more"


class LongWait:
    """One bounded wait: `slice()` for the next blocking call, `tick()` after one that did not end it."""

    def __init__(
        self, what: str, timeout: float, announce: Callable[[str], None], interval: float = WAIT_PROGRESS_SECONDS
    ):
        self.what = what
        self.timeout = timeout
        self.deadline = time.monotonic() + timeout
        self.interval = interval
        self.progress = WaitProgress(announce, interval)  # the first line after one interval

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def slice(self) -> float:
        """How long the next blocking call may take: at most one interval, never past the bound."""
        return max(0.0, min(self.left(), self.interval))

    def tick(self) -> bool:
        """After a slice that did not end the wait: False once the bound is reached; else True,
        and the progress line when one is due."""
        left = self.left()
        if left <= 0:
            return False
        self.progress.tick(lambda: left_line(self.what, left))
        return True


def wait_in_slices(
    wait: Callable[[float], T],
    timeout: float,
    what: str,
    announce: Callable[[str], None],
    done: Callable[[T], bool] = bool,
) -> T:
    """Call `wait(seconds)` in slices until `done(result)` or `timeout` has passed; the last result.
    Every few seconds in between, `announce` hears what is awaited and how long it may still last."""
    long_wait = LongWait(what, timeout, announce)
    while True:
        # wait: slice, said by wait_in_slices: slices of at most WAIT_PROGRESS_SECONDS up to the caller's timeout
        result = wait(long_wait.slice())
        if done(result) or not long_wait.tick():
            return result
