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

At the job's end (success, failure for good, a stop) the newest in-memory step is made durable
first, within the grace period: a whole state by the holder's persister, a sharded (DCP) one by
a helper process that writes the ranks' parts the stopped workers could not write any more and
publishes the step (agent/checkpoint/sharded/flush.py): "saving at the breakpoint".
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rally.agent.base.event_log import EventLog
from rally.agent.checkpoint.checkpoint_dir import newest_checkpoint_step
from rally.agent.checkpoint.core.client import CheckpointRefused, MemoryTier
from rally.agent.checkpoint.sharded import files as dcp_files
from rally.agent.checkpoint.sharded import flush as dcp_flush
from rally.agent.checkpoint.tier import CheckpointTier
from rally.rendezvous.records import Assignment


class NodeCheckpoints:
    """This node's checkpoints as the agent sees them."""

    def __init__(
        self, checkpoint_dir: str | None, events: EventLog, warn: Callable[[str], None],
        run_id: str = "", say: Callable[[str], None] | None = None,
    ) -> None:  # fmt: skip
        self.checkpoint_dir = checkpoint_dir
        self.tier = CheckpointTier.start(checkpoint_dir, events, warn)
        self.events, self.warn, self.say = events, warn, say or warn
        self.run_id = run_id
        self.round: int | None = None  # the last round opened: names a sharded step's temporary directory

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
        self.round = a.round
        self.tier.open_round(a.round, a.resume_step, max(10.0, 2 * keep_alive_timeout))

    def renew(self) -> None:
        self.tier.renew()  # the fence's lease: a frozen agent's workers cannot checkpoint

    def close_round(self, a: Assignment) -> None:
        self.tier.close_round(a.round)  # from now on a save of this round's workers is refused

    def status_fields(self) -> dict[str, Any]:
        """The last saved and durable steps, for `rally status`, the live view and /metrics."""
        return self.tier.status_fields()

    def finish(self, timeout: float) -> str | None:
        """The job is over: make the newest in-memory step durable (bounded), then free the memory.
        Returns one line when the newest saved step never reached disk because the holder died
        (the agent then does not report success), else None."""
        deadline = time.monotonic() + timeout
        self.tier.flush(timeout)
        try:
            self.flush_sharded(max(0.0, deadline - time.monotonic()))
        finally:
            self.tier.stop()
        return self.tier.lost()

    def flush_sharded(self, seconds: float) -> None:
        """Sharded steps in this node's memory newer than the newest on disk are written by
        agent/checkpoint/sharded/flush.py (a helper: publishing needs torch), at most ``seconds``."""
        address = getattr(self.tier, "address", None)
        if address is None or self.tier.died or self.checkpoint_dir is None or seconds <= 0:
            return
        directory = Path(self.checkpoint_dir)
        durable = dcp_files.newest_intact_step(directory)
        client = MemoryTier(address, -1)
        try:
            held = client.held("dcp")
        except CheckpointRefused:
            return
        finally:
            client.close()
        if not any(s > (durable if durable is not None else -1) for steps in held.values() for s in steps):
            return
        env = {
            **os.environ,
            **address.env(),  # the holder's address and the job's secret: in the environment, never in argv
            "RALLY_ROUND": str(self.round or 0),
            "TORCHELASTIC_RUN_ID": self.run_id or os.environ.get("TORCHELASTIC_RUN_ID", "local"),
        }
        command = [sys.executable, str(Path(dcp_flush.__file__).resolve()), str(directory), f"{seconds:.3f}"]
        self.say(f"writing the newest sharded checkpoint held only in memory to {directory} (up to {seconds:.0f} s)")
        try:
            # wait: bounded, said by NodeCheckpoints.flush_sharded: the job's end: what is left of
            # --shutdown-timeout, + 5 s
            done = subprocess.run(
                command, env=env, stdout=subprocess.PIPE, timeout=seconds + 5.0, check=False, start_new_session=True
            )
            result = json.loads(done.stdout.decode().strip().splitlines()[-1])
        except (subprocess.TimeoutExpired, ValueError, IndexError, OSError) as exc:
            result = {
                "warn": (
                    f"the newest sharded checkpoint in memory was not made durable in {seconds:.0f} s "
                    f"({type(exc).__name__})"
                )
            }
        if "step" in result:
            self.tier.last_durable = max(self.tier.last_durable or -1, int(result["step"]))
            self.events.emit("checkpoint_durable", step=result["step"], path=result["path"], where="breakpoint")
            self.say(
                f"sharded checkpoint step {result['step']} was only in memory: written to {result['path']} before exit"
            )
        elif "warn" in result:
            self.warn(str(result["warn"]))
            self.events.emit("checkpoint_warning", line=result["warn"])
