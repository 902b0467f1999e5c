"""The agent's side of the memory tier: start the holder, fence it by round, hear what it saved.

The agent (agent/agent.py) calls, in its own order of things::

    tier = CheckpointTier.start(checkpoint_dir, events, warn)    # at agent start (NoTier: none)
    tier.env()                     # RALLY_CKPT_HOLDER for every worker
    tier.memory_steps()            # this node's in-memory steps, for the round's descriptor
    tier.open_round(r, resume, lease)    # before the round's workers start
    tier.renew(r)                  # while they run (a frozen agent stops renewing: saves refused)
    tier.close_round(r)            # before they are stopped: a late save is refused
    tier.flush(seconds)            # at the job's end: make the newest copy durable, bounded
    tier.stop()                    # frees the shared memory

A thread reads the holder's news: ``saved`` and ``durable`` steps go to events.jsonl
(``checkpoint_saved``, ``checkpoint_durable``) and to :meth:`status_fields` (``rally status``,
/metrics); a ``warn`` is one line on the console (shared memory too small, disk full).
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rally.agent.checkpoint import holder as ckpt_holder
from rally.agent.checkpoint.client import HOLDER_ENV
from rally.agent.display import console
from rally.agent.helper_process import HelperProcess
from rally.agent.observe.event_log import EventLog
from rally.agent.worker.job import newest_checkpoint_step
from rally.rendezvous.long_wait import LongWait

MEMORY_LIMIT_ENV = "RALLY_CKPT_MEMORY_LIMIT"
"""Bytes the tier's copies may take on this node in all (default: half of what is available)."""
MEMORY_TIER_ENV = "RALLY_MEMORY_TIER"
"""Set to 0 to turn the memory tier off: every save then goes straight to disk."""
REPLY_TIMEOUT = 10.0
"""Seconds the agent waits for an answer of the holder outside a flush."""
RENEW_INTERVAL = 1.0
"""How often the agent renews the round's lease at most (seconds)."""


class CheckpointTier:
    def __init__(
        self,
        helper: HelperProcess,
        holder_id: str,
        checkpoint_dir: Path | None,
        events: EventLog,
        warn: Callable[[str], None],
    ) -> None:
        self.helper = helper
        self.process = helper.process
        self.checkpoint_dir = checkpoint_dir
        self.holder_id = holder_id
        self.events = events
        self.warn = warn
        self.last_saved: int | None = None
        self.last_durable: int | None = None
        self.memory: list[int] = []
        self._replies: queue.Queue[dict[str, Any]] = queue.Queue()
        self._next_id = 0
        self._lock = threading.Lock()
        self._renewed = 0.0
        self._round: int | None = None
        self._lease = 10.0
        threading.Thread(target=self._read, daemon=True, name="rally-ckpt-tier").start()

    @classmethod
    def start(
        cls, checkpoint_dir: str | None, events: EventLog, warn: Callable[[str], None]
    ) -> CheckpointTier | NoTier:
        """Start the holder; a :class:`NoTier` (saves go to disk) when the tier is turned off.
        Without a checkpoint directory the holder runs too: a script's checkpoints then live in
        memory only (rally.job saves them with ``persist=False``), so restarts within the job
        resume from them and a script written for rally needs no flag."""
        if os.environ.get(MEMORY_TIER_ENV, "1") == "0":
            return NoTier()
        holder_id = os.urandom(8).hex()  # names its socket and memfds; not a secret (the socket checks the user)
        limit = os.environ.get(MEMORY_LIMIT_ENV, "")
        helper = HelperProcess(ckpt_holder.__file__, holder_id, checkpoint_dir or "", limit, stdout=subprocess.PIPE)
        # Not waited for: a worker that comes before the holder's socket is bound retries
        # (agent/checkpoint/client.py), and the agent's first question waits for its answer.
        return cls(helper, holder_id, Path(checkpoint_dir) if checkpoint_dir else None, events, warn)

    @property
    def pid(self) -> int:
        return self.process.pid

    def env(self) -> dict[str, str]:
        return {HOLDER_ENV: self.holder_id}

    # ------------------------------------------------------------------ talking to the holder
    def _send(self, message: dict[str, Any]) -> bool:
        return self.helper.send(json.dumps(message))

    def _ask(self, wait: float, **message: Any) -> dict[str, Any] | None:
        with self._lock:
            self._next_id += 1
            ident = self._next_id
            if not self._send({**message, "id": ident}):
                return None
            what = (  # the job-end flush can take --shutdown-timeout; the others answer at once
                f"waiting for the newest in-memory checkpoint to be written to {self.checkpoint_dir}"
                if message.get("op") == "flush"
                else f"waiting for the checkpoint holder (pid {self.pid}) to answer '{message.get('op')}'"
            )
            long_wait = LongWait(what, wait, console.say)  # in slices, with a line every few seconds
            while True:
                try:
                    reply = self._replies.get(timeout=long_wait.slice())
                except queue.Empty:
                    if long_wait.tick():
                        continue
                    return None
                if reply.get("reply") == ident:
                    return reply
                if long_wait.left() <= 0:
                    return None

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            try:
                msg = json.loads(line)
            except ValueError:
                continue
            if "reply" in msg:
                self._replies.put(msg)
            elif msg.get("ev") == "saved":
                self.last_saved, self.memory = msg["step"], msg.get("memory", self.memory)
                self.events.emit("checkpoint_saved", step=msg["step"], key=msg.get("key"), where="memory")
            elif msg.get("ev") == "durable":
                self.last_durable = max(self.last_durable or -1, msg["step"])
                self.events.emit("checkpoint_durable", step=msg["step"], path=msg.get("path"))
            elif msg.get("ev") == "warn":
                self.warn(str(msg.get("line", "")))
                self.events.emit("checkpoint_warning", line=msg.get("line"))

    # ------------------------------------------------------------------ the agent's calls
    def memory_steps(self) -> list[int]:
        reply = self._ask(REPLY_TIMEOUT, op="holdings")
        if reply is not None:
            self.memory = list(reply.get("memory", []))
        return self.memory

    def open_round(self, r: int, resume_step: int | None, lease: float) -> None:
        if self.last_durable is None and self.checkpoint_dir is not None:  # what earlier runs left (cached)
            self.last_durable = newest_checkpoint_step(self.checkpoint_dir)
        self._round, self._lease, self._renewed = r, lease, time.monotonic()
        self._ask(REPLY_TIMEOUT, op="round", round=r, resume=resume_step, lease=lease)

    def renew(self) -> None:
        now = time.monotonic()
        if self._round is not None and now - self._renewed >= RENEW_INTERVAL:
            self._renewed = now
            self._send({"op": "renew", "round": self._round, "lease": self._lease})

    def close_round(self, r: int) -> None:
        self._round = None
        self._ask(REPLY_TIMEOUT, op="over", round=r)

    def flush(self, timeout: float) -> bool:
        """Wait until the newest copy is durable (or its write failed), at most ``timeout``; True if done."""
        reply = self._ask(timeout + 1.0, op="flush", timeout=timeout)
        return reply is not None and not reply.get("pending", True)

    def status_fields(self) -> dict[str, Any]:
        return {"checkpoint_saved_step": self.last_saved, "checkpoint_durable_step": self.last_durable}

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the holder (its memory goes with it); killed if it does not stop in time."""
        self._send({"op": "stop"})
        self.helper.stop(timeout)


class NoTier:
    """No memory tier (no checkpoint directory, or turned off): every call does nothing."""

    pid = None
    last_saved = last_durable = None

    def env(self) -> dict[str, str]:
        return {}

    def memory_steps(self) -> list[int]:
        return []

    def open_round(self, r: int, resume_step: int | None, lease: float) -> None:
        pass

    def renew(self) -> None:
        pass

    def close_round(self, r: int) -> None:
        pass

    def flush(self, timeout: float) -> bool:
        return True

    def status_fields(self) -> dict[str, Any]:
        return {}

    def stop(self, timeout: float = 5.0) -> None:
        pass
