"""The worker's end of the memory tier: what `rally.job.save` and `load_latest` use under rally.

The agent's holder (agent/checkpoint/holder.py) owns the shared memory; a worker only asks it for a
slot, copies its state into the slot and says it is complete:

    tier = MemoryTier.from_env()                     # None outside rally, or without a holder
    saved = tier.save(state, "whole", step, persist=True, keep=3)   # False: shm too small
    step, fd = tier.resume("whole")                  # the round's agreed step; a memfd if in memory

`save` returns once the copy is in shared memory, or once the tensors an optimizer owns are
handed to the copy thread (agent/checkpoint/core/overlap.py: the copy overlaps the next step, its
reserve and commit are that thread's); the holder persists it in the background.
Requests and answers are packets on the holder's abstract SOCK_SEQPACKET socket, a slot's memfd
travelling with the answer (see agent/checkpoint/core/shm.py for the layout).

Who answers is checked before anything is sent: the socket's name is random and bound by the
agent before the holder starts (nobody can take it first), and the peer must be the holder the
agent started (SO_PEERCRED: its pid, RALLY_CKPT_HOLDER_PID, and this process's uid), else
`CheckpointRefused`. The first packet on every connection is `hello` with the job's
connection secret (RALLY_CKPT_SECRET): a process of the same user that is not one of this job's
workers (another job's) is turned away by the holder.
A save the holder refuses (this worker's round is over, a bad request) raises
`CheckpointRefused` with the holder's one line. Requests go over one Unix-socket
connection per worker process, kept open between saves (so the holder knows the writer is alive:
a worker killed mid-copy closes it, and the half-written slot is dropped).

For other state layouts (per-rank shards, DCP storage) `reserve`/`commit`/`abort` are the
same steps one by one: reserve a slot of `size` bytes for a key (a writable mapping of it),
fill it, commit its length; or abort.
"""

from __future__ import annotations

import array
import functools
import json
import mmap
import os
import socket
import struct
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from rally.agent.base import kept_threads
from rally.agent.checkpoint.core import layout
from rally.agent.checkpoint.core.overlap import NoRoomInMemory, PendingCopy, SaveSkipped, in_place_version, overlap
from rally.agent.checkpoint.core.shm import (
    ArchiveTooLarge,
    SlotMaps,
    archive_size,
    socket_address,
    storage_bytes,
    write_archive,
)

WHOLE_STATE_KEY = "whole"
"""The key of a state every rank holds alike (DDP), saved once per node by `rally.job.save`."""
HOLDER_ENV = "RALLY_CKPT_HOLDER"
"""The holder's socket's name (random); set by the agent in every worker's environment when the tier runs."""
HOLDER_PID_ENV = "RALLY_CKPT_HOLDER_PID"
"""The holder's pid: the only process a worker accepts as the peer of that socket."""
HOLDER_LOST_ENV = "RALLY_CKPT_HOLDER_LOST"
"""1: this node's holder died in an earlier round and the tier is off (set instead of the three
above): rally.job then saves to disk, or without a checkpoint directory says once that checkpoints are off."""
SECRET_ENV = "RALLY_CKPT_SECRET"
"""The job's connection secret: the holder serves only connections that present it."""
MEMORY_ONLY_ENV = "RALLY_CKPT_MEMORY_ONLY"
""""1" when the agent has no --checkpoint-dir: its holder keeps copies in memory and persists none."""
MAX_PACKET = 64 * 1024
CONNECT_TIMEOUT = 10.0
"""Seconds a worker waits for the holder's socket to appear (the agent starts both at once)."""
REPLY_TIMEOUT = 60.0
"""Seconds a worker waits for one answer of the holder (it answers in microseconds unless wedged)."""


class CheckpointRefused(RuntimeError):
    """rally refused a save or a load: the message says why, on one line.

    Raised when a worker of a round that is over saves (its checkpoint would mix with the new
    round's), or when the memory tier's socket is not the one this node's agent made. See
    [Troubleshooting](troubleshooting.md#checkpoint-refused).
    """


@dataclass(frozen=True)
class HolderAddress:
    """How a worker reaches its node's holder and knows it is that holder: the socket's name, the
    holder's pid, and the job's connection secret. Handed to workers in the environment (read
    only by the job's user), never on a command line."""

    name: str
    pid: int
    secret: str

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> HolderAddress | None:
        env = os.environ if environ is None else environ
        name, pid, secret = env.get(HOLDER_ENV, ""), env.get(HOLDER_PID_ENV, ""), env.get(SECRET_ENV, "")
        if not name:
            return None
        if not pid.isdigit() or not secret:
            raise CheckpointRefused(
                f"rally: {HOLDER_ENV} is set without {HOLDER_PID_ENV} and {SECRET_ENV}: the checkpoint holder "
                "cannot be verified (set by rally's agent only; unset them outside rally)"
            )
        return cls(name, int(pid), secret)

    def env(self) -> dict[str, str]:
        return {HOLDER_ENV: self.name, HOLDER_PID_ENV: str(self.pid), SECRET_ENV: self.secret}


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end of a Unix socket, from the kernel."""
    pid, uid, gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    return pid, uid, gid


class MemoryTier:
    def __init__(self, holder: HolderAddress, round_: int) -> None:
        self.holder = holder
        self.address = socket_address(holder.name)
        self.round = round_
        self.maps = SlotMaps()
        self._sizes: dict[str, tuple[int, int]] = {}  # key -> (bytes of tensors, archive length) at the last save
        self._layouts: dict[str, layout.Layout] = {}  # key -> the last archive's layout, for the fast path
        self._inline = False  # an overlapped save found no room: the next save reserves before it returns
        self.premap_wanted: set[str] = set()  # keys whose next slots to map after their next reserve (`premap`)
        self.premapping: kept_threads.Call | None = None  # the last premap started
        self._reserved: set[str] = set()  # keys this process has saved
        # the premap renewing a restart's slots: overlapped saves skip while it runs
        self._restart_premap: kept_threads.Call | None = None
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()
        # Every answer is received here, private anonymous memory mapped once (its pages resident once
        # written): socket.recv_fds allocated MAX_PACKET per answer and shrank it, in the calling
        # thread's glibc arena, whose heap crept up around the small pieces left (a re-entered worker's RSS)
        self._buffer = mmap.mmap(-1, MAX_PACKET, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)

    @classmethod
    def from_env(cls) -> MemoryTier | None:
        holder = HolderAddress.from_env()
        if holder is None:
            return None
        return cls(holder, int(os.environ.get("RALLY_ROUND", "0") or 0))

    def request(self, **message: object) -> tuple[dict[str, Any], list[int]]:
        """One request, its answer and the memfds that came with it; reconnects once if the
        connection broke (not for commit/abort: a new connection owns no slot)."""
        with self._lock:
            for attempt in (0, 1):
                try:
                    if self._sock is None:
                        self._connect()
                    assert self._sock is not None
                    self._sock.sendall(json.dumps(message).encode())
                    data, fds = self._receive(self._sock, 4)
                    if not data:
                        for fd in fds:
                            os.close(fd)
                        raise ConnectionResetError("the holder closed the connection")
                    return json.loads(data), fds
                except (OSError, ValueError) as exc:
                    self.close()
                    if attempt or message.get("op") in ("commit", "abort", "copied"):
                        raise CheckpointRefused(
                            f"rally: the checkpoint holder of this node is unreachable ({exc})"
                        ) from None
                except BaseException:
                    # Interrupted between the request and its answer (rally.job.run's abort raises
                    # at any bytecode): the answer still comes, and on this connection the next
                    # request, of the next round, would read it as its own. A new connection
                    # instead; what this one was writing is dropped (its round is over).
                    self.close()
                    raise
        raise AssertionError("unreachable")

    def _connect(self) -> None:
        """Connect, waiting (bounded) for a holder that is still starting next to a fast worker;
        then make sure the peer is the holder the agent started, and present the job's secret."""
        deadline = time.monotonic() + CONNECT_TIMEOUT
        while True:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            sock.settimeout(REPLY_TIMEOUT)
            try:
                sock.connect(self.address)
            except ConnectionRefusedError:
                sock.close()
                if time.monotonic() > deadline:
                    raise
                # wait: short: 20 ms between tries for a holder still binding its socket, CONNECT_TIMEOUT (10 s) in
                # all
                time.sleep(0.02)
                continue
            break
        try:
            pid, uid, _ = peer_credentials(sock)
            if pid != self.holder.pid or uid != os.geteuid():
                raise CheckpointRefused(
                    f"rally: the checkpoint socket is served by pid {pid} (uid {uid}), not by this node's holder "
                    f"(pid {self.holder.pid}, uid {os.geteuid()}): refusing it; nothing was sent"
                )
            sock.sendall(json.dumps({"op": "hello", "secret": self.holder.secret}).encode())
            data, fds = self._receive(sock, 1)
            for fd in fds:
                os.close(fd)
            if not data or not json.loads(data).get("ok"):
                raise ConnectionResetError("the holder turned this connection away (not this job's secret)")
        except BaseException:
            sock.close()
            raise
        self._sock = sock

    def _receive(self, sock: socket.socket, max_fds: int) -> tuple[bytes, list[int]]:
        """One answer and the descriptors that came with it (as socket.recv_fds), into `_buffer`."""
        fds = array.array("i")
        size, ancillary, _, _ = sock.recvmsg_into([self._buffer], socket.CMSG_LEN(max_fds * fds.itemsize))
        for level, kind, payload in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
        return self._buffer[:size], list(fds)

    def close(self) -> None:
        if self._sock is not None:
            try:
                self._sock.close()
            except OSError:
                pass
        self._sock = None

    def _checked(self, answer: dict[str, Any], fds: list[int]) -> None:
        if not answer.get("ok"):
            for fd in fds:
                os.close(fd)
            raise CheckpointRefused(answer.get("error", "rally: checkpoint refused"))

    def reserve(
        self, key: str, step: int, size: int, persist: bool | str, keep: int, spare_newest: bool = False
    ) -> mmap.mmap | None:
        """A writable mapping of a slot with room for `size` bytes; None when memory is too
        short for a copy (the caller saves to disk instead). `persist`: False keeps the copy in
        memory only; True has the holder write it as `step_<step>.pt` (keep-K pruning); a
        relative file name has it written there (no pruning), e.g. one rank's shard."""
        answer, fds = self.request(
            op="reserve", key=key, step=step, size=size, round=self.round, persist=persist, keep=keep,
            spare_newest=spare_newest,
        )  # fmt: skip
        restarted = key in self.premap_wanted  # asked by the resume prefetch: slots to renew after a restart
        if key not in self._reserved:  # a key's first save: the holder is making its other slot
            self._reserved.add(key)
            self.premap_wanted.add(key)
        if key in self.premap_wanted:  # the round's first save: the holder has started making fresh memory
            self.premap_wanted.discard(key)
            self.premapping = _premaps.start(functools.partial(self._premap_quietly, key))
            self._restart_premap = self.premapping if restarted else None
        if answer.get("disk_only"):
            return None
        if answer.get("busy"):
            raise SaveSkipped(answer.get("error", "rally: checkpoint skipped"))
        self._checked(answer, fds)
        # after a restart, while its premap maps: rather skipped than a stall
        skip = spare_newest and self._restart_premap is not None and self._restart_premap.is_alive()
        mapped = self.maps.mapping(f"{key}.{answer['slot']}", fds[0], wait=not skip)
        if mapped is None:  # the premap thread is mapping this slot: skipped rather than a stall
            self.abort(key, step, ended=True)
            raise SaveSkipped("rally: checkpoint skipped: the slot is still being mapped")
        return mapped

    def _premap_quietly(self, key: str) -> None:
        try:
            self.premap(key)
        except Exception:  # noqa: BLE001 - best effort: a save maps what is missing, and says what is wrong
            return

    def premap(self, key: str) -> None:
        """Map, and fault in, the slots the next saves of `key` will write, before they come: a
        fresh memfd's 100,000 pages per 400 MB take ~0.15 s to map on a quiet machine (several
        times that beside training), which the first saves after a restart used to stall on.
        Run on a thread of its own after the round's first reserve of `key` (`premap_wanted`, set
        by the resume prefetch, agent/checkpoint/core/resume_prefetch.py): the holder starts making
        the fresh memory then, and this waits for it."""
        answer, fds = self.request(op="next_slots", key=key)
        slots = answer.get("slots") if answer.get("ok") else None
        if not isinstance(slots, list) or len(slots) != len(fds):
            for fd in fds:
                os.close(fd)
            return
        for index, fd in zip(slots, fds, strict=True):  # lengths checked above
            self.maps.mapping(f"{key}.{index}", fd)

    def commit(self, key: str, step: int, length: int) -> None:
        self._checked(*self.request(op="commit", key=key, step=step, length=length, round=self.round))

    def abort(self, key: str, step: int, *, ended: bool = False) -> None:
        """Let the reservation of `step` go. `ended`: every write into the slot for it is over
        (no thread of this process still copies into it), so the holder may hand the slot out again
        even if the round ended meanwhile (agent/checkpoint/slots.py, fenced slots)."""
        try:
            self.request(op="abort", key=key, step=step, ended=ended)
        except CheckpointRefused:
            pass

    def save(self, state: Any, key: str, step: int, *, persist: bool | str, keep: int) -> bool:
        """Copy `state` into a slot as `step`; True once committed or handed to the copy thread
        (agent/checkpoint/core/overlap.py), False if disk-only.

        A state laid out as the last one saved under `key` (a training loop's case) is copied
        tensor by tensor straight into the slot (agent/checkpoint/core/layout.py): the stall is a
        plain copy. Otherwise torch.save writes the archive into the slot, and its layout is
        learnt for the next save. The slot must be as large as torch.save's archive. Finding its
        exact length takes a pass of torch.save that copies nothing (pickling only, ~2 ms for
        100 tensors); when the state's tensors are the same sizes as at the last save the last
        length plus its pickle's length again as slack is reserved instead, and only a state
        that outgrew it pays for the exact pass and a second try.
        """
        overlap.settle()  # the previous save's copy, if still in flight: one copy at a time
        views: list[tuple[int, Any]] = []
        found = layout.signature(state, views)
        known = self._layouts.get(key)
        if found is None or known is None or known.signature != found[0]:
            return self._save_archive(state, key, step, persist, keep, found, views)
        size = _room(known.length, sum(s.nbytes() for s in found[1]))
        later = set(overlap.background(found[1])) if not self._inline else set()
        if later:
            self._save_overlapped(state, key, step, size, persist, keep, known, found[1], views, later)
            return True
        target = self.reserve(key, step, size, persist, keep)
        if target is None:
            return False
        self._inline = False
        try:
            length = known.write(found[1], target)
        except BaseException:
            self.abort(key, step)
            raise
        self.commit(key, step, length)
        return True

    def _save_overlapped(
        self, state: object, key: str, step: int, size: int, persist: bool | str, keep: int, known: layout.Layout,
        storages: list[Any], views: list[tuple[int, Any]], later: set[int],
    ) -> None:  # fmt: skip
        """The fast path with the storages `later` copied by the copy thread
        (agent/checkpoint/core/overlap.py). The others are copied now into memory of this process's
        own (they may change before the copy thread gets to them: buffers, small tensors), and the
        holder's two round trips, reserve and commit, are the copy thread's too: the training
        thread pays a walk of the state and the copy of what the optimizers do not own."""
        sources = [s if i in later else layout.bytes_of(s).clone() for i, s in enumerate(storages)]
        watched = [(tensor, in_place_version(tensor)) for i, tensor in views if i in later]

        def copy() -> None:
            target = self.reserve(key, step, size, persist, keep, spare_newest=True)  # SaveSkipped: see overlap.py
            if target is None:
                self._inline = True  # the next save reserves first: it can go to disk if memory is short
                raise NoRoomInMemory(
                    f"rally: warning: checkpoint step {step} was not kept: this node's memory is too short for it "
                    "now; the next save is written to disk if it still is"
                )
            try:
                known.write(sources, target)
            except BaseException:
                self.abort(key, step)
                raise

        overlap.start(PendingCopy(self, key, step, known.length, copy, watched, state))

    def copied(self, key: str, step: int) -> None:
        """Tell the holder that an overlapped save's copy is done (its commit is decided later):
        its persister, which pauses while a worker copies, may go on. Best effort."""
        try:
            self.request(op="copied", key=key, step=step)
        except CheckpointRefused:
            pass

    def _save_archive(
        self, state: Any, key: str, step: int, persist: bool | str, keep: int, found: Any,
        views: list[tuple[int, Any]],
    ) -> bool:  # fmt: skip
        """The save through torch.save (a new layout), learning the layout when it is eligible.
        The data of the storages an optimizer owns is left out of torch.save's writes and copied
        into its place by the copy thread (agent/checkpoint/core/overlap.py), as on the fast path:
        the first save after a restart overlaps the next step too."""
        tensors = storage_bytes(state)
        known = self._sizes.get(key)
        guess = _room(known[1], known[0]) if known and known[0] == tensors else None
        later = set(overlap.background(found[1])) if found is not None and not self._inline else set()
        for size in (guess, None):
            if size is None:
                size = _room(archive_size(state), tensors)  # the same room as a guess: the slot fits both
            target = self.reserve(key, step, size, persist, keep)
            if target is None:
                return False
            self._inline = False
            recorder = layout.Recorder(found[1], later) if found is not None else None
            try:
                length = write_archive(state, target, recorder)
            except ArchiveTooLarge:
                self.abort(key, step)
                continue
            except BaseException:
                self.abort(key, step)
                raise
            self._sizes[key] = (tensors, length)
            learnt = recorder.layout(found[0], length) if recorder is not None else None
            if learnt is not None:
                self._layouts[key] = learnt
            else:
                self._layouts.pop(key, None)
            if recorder is None or not recorder.deferred:
                self.commit(key, step, length)
                return True
            placed = [(found[1][i], recorder.data[i]) for i in recorder.deferred]
            watched = [(tensor, in_place_version(tensor)) for i, tensor in views if i in set(recorder.deferred)]
            overlap.start(
                PendingCopy(
                    self, key, step, length, functools.partial(layout.copy_into, target, length, placed), watched, state
                )
            )
            return True
        raise AssertionError("unreachable: the exact size always fits")

    def resume(self, key: str) -> tuple[int | None, int | None]:
        """(the step every rank of the round resumes from, None: no agreement, read the disk;
        a memfd holding it on this node, None: not in memory here). The caller closes the memfd,
        e.g. after `torch.load(fd_path(fd), mmap=True)`: its mapping keeps the memory."""
        answer, fds = self.request(op="resume", key=key)
        self._checked(answer, fds)
        return answer.get("step"), fds[0] if fds else None

    def held(self, prefix: str) -> dict[str, list[int]]:
        """Committed steps in this node's memory of every key starting with `prefix`."""
        answer, fds = self.request(op="held", prefix=prefix)
        self._checked(answer, fds)
        return {str(k): [int(s) for s in v] for k, v in answer["held"].items()}

    def mapped_slot(self, key: str, step: int) -> memoryview | None:
        """Committed `step` of `key` on this node, mapped (None: not held here). Mapped, not
        copied: the holder never writes a slot it handed out again. Private and writable, so
        `torch.frombuffer` views it without a warning; nothing writes to it."""
        found = self.slot(key, step)
        if found is None:
            return None
        fd, length = found
        try:
            mapped = mmap.mmap(fd, length, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        return memoryview(mapped)

    def slot(self, key: str, step: int) -> tuple[int, int] | None:
        """(a memfd holding committed `step` of `key` on this node, its length), or None.
        The caller closes the memfd."""
        answer, fds = self.request(op="slot", key=key, step=step)
        self._checked(answer, fds)
        return (fds[0], int(answer["length"])) if fds else None


def _room(length: int, tensors: int) -> int:
    """The slot size asked for an archive of `length` bytes, `tensors` of them tensor data:
    room for the pickled rest to double, plus 64 KiB. Asked alike for exact and cached sizes, so
    a slot sized at the first save is reused by every later save of a same-size state."""
    return length + max(length - tensors, 0) + (64 << 10)


_tier: MemoryTier | None = None
_tier_resolved = False


_premaps = kept_threads.Pool("rally-slot-premap")
"""One kept thread maps the next slots (`MemoryTier.premap`), the same for every re-entry."""


def persists() -> bool:
    """Whether this job's holder writes its copies to disk (the agent was given --checkpoint-dir)."""
    return os.environ.get(MEMORY_ONLY_ENV) != "1"


def forget_tier() -> None:
    """Let go of this process's connection to the holder: the next `tier()` reads the environment
    again (rally.job.run's next round, whose holder died: RALLY_CKPT_HOLDER_LOST)."""
    global _tier, _tier_resolved
    if _tier is not None:
        _tier.close()
    _tier, _tier_resolved = None, False


def tier() -> MemoryTier | None:
    """This process's connection to the holder, made once; None outside rally's memory tier.

    Resolved lazily, so a worker forked from the agent's template reads its own environment.
    """
    global _tier, _tier_resolved
    if not _tier_resolved:
        _tier = MemoryTier.from_env()
        _tier_resolved = True
    return _tier
