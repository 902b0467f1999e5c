"""The worker's end of the memory tier: what ``rally.job.save`` and ``load_latest`` use under rally.

The agent's holder (agent/ckpt_holder.py) owns the shared memory; a worker only asks it for a
slot, copies its state into the slot and says it is complete::

    tier = MemoryTier.from_env()                     # None outside rally, or without a holder
    saved = tier.save(state, "whole", step, persist=True, keep=3)   # False: shm too small
    step, path = tier.resume("whole")                # the round's agreed step; path if in memory

``save`` returns once the copy is in shared memory; the holder persists it in the background.
A save the holder refuses (this worker's round is over, a bad request) raises
:class:`CheckpointRefused` with the holder's one line. Requests go over one Unix-socket
connection per worker process, kept open between saves (so the holder knows the writer is alive:
a worker killed mid-copy closes it, and the half-written slot is dropped).

For other state layouts (per-rank shards, DCP storage) ``reserve``/``commit``/``abort`` are the
same steps one by one: reserve a slot of ``size`` bytes for a key, fill the returned path's
mapping (``maps.mapping``), commit its length.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any

from rally.agent.ckpt_shm import SlotMaps, archive_size, write_archive

HOLDER_ENV = "RALLY_CKPT_HOLDER"
"""The holder's socket path; set by the agent in every worker's environment when the tier runs."""
CONNECT_TIMEOUT = 10.0
"""Seconds a worker waits for the holder's socket to appear (the agent starts both at once)."""
REPLY_TIMEOUT = 60.0
"""Seconds a worker waits for one answer of the holder (it answers in microseconds unless wedged)."""


class CheckpointRefused(RuntimeError):
    """The holder refused a save, e.g. from a worker of a round that is over."""


class MemoryTier:
    def __init__(self, socket_path: str, round_: int) -> None:
        self.socket_path = socket_path
        self.round = round_
        self.maps = SlotMaps()
        self._sock: socket.socket | None = None
        self._stream: Any = None
        self._lock = threading.Lock()

    @classmethod
    def from_env(cls) -> MemoryTier | None:
        path = os.environ.get(HOLDER_ENV, "")
        if not path:
            return None
        return cls(path, int(os.environ.get("RALLY_ROUND", "0") or 0))

    def request(self, **message: Any) -> dict[str, Any]:
        """One request and its answer; reconnects once if the connection broke."""
        with self._lock:
            for attempt in (0, 1):
                try:
                    if self._sock is None:
                        self._connect()
                    self._sock.sendall((json.dumps(message) + "\n").encode())
                    line = self._stream.readline()
                    if not line:
                        raise ConnectionResetError("the holder closed the connection")
                    return json.loads(line)
                except OSError as exc:
                    self.close()
                    if attempt or message.get("op") in ("commit", "abort"):  # a new connection owns no slot
                        raise CheckpointRefused(f"rally: the checkpoint holder is unreachable at {self.socket_path} ({exc})") from None
        raise AssertionError("unreachable")

    def _connect(self) -> None:
        """Connect, waiting (bounded) for a holder that is still starting next to a fast worker."""
        deadline = time.monotonic() + CONNECT_TIMEOUT
        while True:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(REPLY_TIMEOUT)
            try:
                sock.connect(self.socket_path)
            except (FileNotFoundError, ConnectionRefusedError):
                sock.close()
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.02)
                continue
            self._sock, self._stream = sock, sock.makefile("rb")
            return

    def close(self) -> None:
        if self._sock is not None:
            try:
                self._sock.close()
            except OSError:
                pass
        self._sock = self._stream = None

    def reserve(self, key: str, step: int, size: int, persist: bool, keep: int) -> Path | None:
        """A slot for ``size`` bytes; None when shared memory is too small (save to disk instead)."""
        answer = self.request(op="reserve", key=key, step=step, size=size, round=self.round, persist=persist, keep=keep)
        if answer.get("ok"):
            return Path(answer["path"])
        if answer.get("disk_only"):
            return None
        raise CheckpointRefused(answer.get("error", "rally: checkpoint refused"))

    def commit(self, key: str, step: int, length: int) -> None:
        answer = self.request(op="commit", key=key, step=step, length=length, round=self.round)
        if not answer.get("ok"):
            raise CheckpointRefused(answer.get("error", "rally: checkpoint refused"))

    def abort(self, key: str, step: int) -> None:
        try:
            self.request(op="abort", key=key, step=step)
        except CheckpointRefused:
            pass

    def save(self, state: Any, key: str, step: int, *, persist: bool, keep: int) -> bool:
        """Copy ``state`` into a slot as ``step``; True once committed, False if disk-only."""
        size = archive_size(state)
        path = self.reserve(key, step, size, persist, keep)
        if path is None:
            return False
        try:
            length = write_archive(state, self.maps.mapping(str(path), size))
        except BaseException:
            self.abort(key, step)
            raise
        self.commit(key, step, length)
        return True

    def held(self, prefix: str) -> dict[str, list[int]]:
        """Committed steps in this node's memory of every key starting with ``prefix``."""
        answer = self.request(op="held", prefix=prefix)
        if not answer.get("ok"):
            raise CheckpointRefused(answer.get("error", "rally: checkpoint holder refused"))
        return {str(k): [int(s) for s in v] for k, v in answer["held"].items()}

    def slot(self, key: str, step: int) -> tuple[Path, int] | None:
        """The slot holding committed ``step`` of ``key`` on this node and its length, or None."""
        answer = self.request(op="slot", key=key, step=step)
        if not answer.get("ok"):
            raise CheckpointRefused(answer.get("error", "rally: checkpoint holder refused"))
        return (Path(answer["path"]), int(answer["length"])) if answer.get("path") else None

    def resume(self, key: str) -> tuple[int | None, Path | None]:
        """The step every rank of the round resumes from (None: no agreement, use the disk), and
        the slot holding it on this node (None: not in memory here)."""
        answer = self.request(op="resume", key=key)
        if not answer.get("ok"):
            raise CheckpointRefused(answer.get("error", "rally: checkpoint holder refused"))
        path = answer.get("path")
        return answer.get("step"), Path(path) if path else None


_tier: MemoryTier | None = None
_tier_resolved = False


def tier() -> MemoryTier | None:
    """This process's connection to the holder, made once; None outside rally's memory tier.

    Resolved lazily, so a worker forked from the agent's template reads its own environment.
    """
    global _tier, _tier_resolved
    if not _tier_resolved:
        _tier = MemoryTier.from_env()
        _tier_resolved = True
    return _tier
