"""The agent's checkpoint side: its memory tier (agent/checkpoint/tier.py) and what the disk holds.

agent/agent.py calls, in its order of things::

    ckpt = NodeCheckpoints(spec.checkpoint_dir, events, warn)   # starts the holder (or none)
    ckpt.env()                       # RALLY_CKPT_HOLDER for every worker
    ckpt.progress()                  # the newest step saved, memory or disk: the crash-loop guard
    ckpt.holdings()                  # (steps in memory, newest intact on disk): the resume step
    ckpt.open_round(a, keep_alive)   # before the round's workers start: fenced to a.round
    ckpt.renew()                     # while they run
    ckpt.close_round(a)              # before they are stopped: a late save is refused
    ckpt.finish(seconds)             # at the job's end: the newest copy made durable, memory freed
"""

from __future__ import annotations

from typing import Any, Callable

from rally.agent.checkpoint.tier import CheckpointTier
from rally.agent.observe.event_log import EventLog
from rally.agent.worker.job import newest_checkpoint_step
from rally.rendezvous.records import Assignment


class NodeCheckpoints:
    """This node's checkpoints as the agent sees them."""

    def __init__(self, checkpoint_dir: str | None, events: EventLog, warn: Callable[[str], None]) -> None:
        self.checkpoint_dir = checkpoint_dir
        self.tier = CheckpointTier.start(checkpoint_dir, events, warn)

    @property
    def pid(self) -> int | None:
        """The holder's pid (a helper of the agent's: never killed as the job's), None without one."""
        return self.tier.pid

    def env(self) -> dict[str, str]:
        return self.tier.env()

    def durable_step(self) -> int | None:
        return newest_checkpoint_step(self.checkpoint_dir) if self.checkpoint_dir else None

    def progress(self) -> int | None:
        """The newest step saved, in memory or on disk: progress, for the crash-loop guard."""
        steps = [s for s in (*self.tier.memory_steps(), self.durable_step()) if s is not None]
        return max(steps) if steps else None

    def holdings(self) -> tuple[list[int], int | None]:
        """(steps in this node's memory, the newest intact on disk): the round agrees on a resume step."""
        return self.tier.memory_steps(), self.durable_step()

    def open_round(self, a: Assignment, keep_alive_timeout: float) -> None:
        """Saves of round `a.round` are accepted from now on, while the agent renews its lease
        (twice the keep-alive timeout, at least 10 s); workers resume from `a.resume_step`."""
        self.tier.open_round(a.round, a.resume_step, max(10.0, 2 * keep_alive_timeout))

    def renew(self) -> None:
        self.tier.renew()  # the fence's lease: a frozen agent's workers cannot checkpoint

    def close_round(self, a: Assignment) -> None:
        self.tier.close_round(a.round)  # from now on a save of this round's workers is refused

    def status_fields(self) -> dict[str, Any]:
        """The last saved and durable steps, for `rally status`, the live view and /metrics."""
        return self.tier.status_fields()

    def finish(self, timeout: float) -> None:
        """The job is over: make the newest in-memory step durable (bounded), then free the memory."""
        self.tier.flush(timeout)
        self.tier.stop()
