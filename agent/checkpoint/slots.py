"""The holder's bookkeeping: which slot holds which step, who may write, what is durable.

Pure state under one condition variable, no I/O but creating and sizing slot files, so the rules
read in one place (agent/checkpoint/holder.py does the sockets and the persister thread):

- **Two slots per key.** A save goes into a slot that is not being persisted, preferring the one
  that does not hold the newest committed step. So a save never waits for the disk, the newest
  committed step stays readable while the next copy is written (unless the other slot is busy
  persisting: then the older of the two in-memory steps is the one being made durable and the
  save overwrites the newest), and no more than two copies per key ever exist.
- **Commit.** A slot counts only once its writer said `commit` on the same connection; a writer
  that dies mid-copy leaves a slot that is never read, and the previous step stays usable.
- **Fencing by round.** The agent opens each round (`round`), renews a lease while its workers
  run, and closes it (`over`) before it stops them. A reserve or commit from another round, a
  closed round or after the lease ran out (a frozen agent) is refused: a worker of a round that
  is over cannot checkpoint.
- **Fenced slots are not written again till their writer lets go.** A copy under way when its
  round closes is void, and its memfd is not reused: the fenced writer (a frozen worker that runs
  on later) may still copy into its mapping, which must not land in the newer round's copy. Unless
  that writer aborts the copy itself, on its connection, saying the copy has ended (rally.job.run's
  survivor between two entries, agent/checkpoint/core/overlap.py `drop_at_round_end`): the slot is
  written again then, through the mapping the worker already has.
- **Reloaded slots are never written again.** `resume` hands a worker the slot's memfd for
  `torch.load(mmap=True)`; the next save that lands on that slot gets a fresh memfd (the old
  one's pages live as long as the worker keeps tensors from it, then the kernel frees them).
- **Fresh memory is made in the background, once training is back.** At a round's first save of
  a key, the holder starts making fresh memfds for that key's slots that need one (reloaded, or
  fenced by a writer that did not let go; agent/checkpoint/fresh_memory.py), and the saving worker
  maps them on a thread of its own (`next_slots`). An overlapped save that lands on a reloaded or
  fenced slot before its memory is ready (made, and mapped) is skipped, as when the other copy is
  being persisted (the newest step stays, the next save tries again): a few steps' saves skipped
  instead of a stall of 0.2-1 s per slot. Any other save waits for it (a key's second save, whose
  slot is being made for the first time). Not earlier: while the workers restart, the node's cores
  are theirs.
- **An overlapped save spares the newest step.** Its slot stays written for a whole training step
  (till the next optimizer step's fence decides its commit), so it asks not to take the newest
  committed step's slot: while the other slot is being persisted it is skipped instead, and a
  worker killed meanwhile still finds the newest step.
- **Copied is not committed.** An overlapped save (agent/checkpoint/core/overlap.py) says `copied`
  when its background copy is done and commits only once its writer has checked that no tensor
  changed meanwhile: till then the slot is written, not readable, but the persister need not
  leave it the memory bandwidth.
- **Memory is checked before it is taken.** A copy may take at most half of the memory still
  available to this node and its cgroup (and stay under RALLY_CKPT_MEMORY_LIMIT if set);
  otherwise that save goes to disk (the tier says so once), and a later save that fits is held
  again: nothing latches. A request for more than the node's whole memory is no state at all:
  it is refused as a bad request.
"""

from __future__ import annotations

import errno
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from rally.agent.checkpoint.core.shm import SLOTS_PER_KEY, memfd_name, valid_key
from rally.agent.checkpoint.fresh_memory import FreshMemory

FREE, WRITING, COMMITTED = "free", "writing", "committed"
PAGE = 4096
RELOAD_PAUSE_SECONDS = 1.0
"""How long after a worker's resume the persister leaves memory bandwidth to the reload."""
PREPARE_WAIT_SECONDS = 0.05
"""A reserve whose slot's fresh memfd is being made waits for it in slices this long (re-checking its round)."""
NEXT_SLOTS_WAIT_SECONDS = 5.0
"""How long `next_slots` waits for fresh memfds still being made (~0.1 s per 400 MB; more under load)."""


class Refused(Exception):
    """A request the holder turns down; the message is one line for the worker to raise."""


class NewestBusy(Refused):
    """The only slot free holds the newest committed step, and the writer asked to spare it."""


class ShmTooSmall(Exception):
    """Not enough shared memory for a copy: the tier falls back to disk-only saving."""


@dataclass
class Slot:
    state: str = FREE
    step: int = -1
    length: int = 0
    size: int = 0  # bytes allocated for the memfd
    fd: int | None = None  # the holder's memfd of this slot
    writer: int | None = None  # the connection writing it
    persist_name: str | None = None  # file name in the checkpoint directory, None: memory only
    keep: int = 3
    persisted: bool = False
    loaded: bool = False  # a worker mapped it: never write into this memfd again
    fenced: tuple[int, int] | None = None  # (connection, step) whose copy a round's end voided; its abort frees it
    copied: bool = False  # its writer's copy is done, its commit still to be decided (an overlapped save)


@dataclass
class KeySlots:
    slots: list[Slot] = field(default_factory=lambda: [Slot() for _ in range(SLOTS_PER_KEY)])
    persisting: int | None = None  # index of the slot the persister is copying

    def committed(self) -> list[tuple[int, int]]:
        """(step, index) of committed slots, newest first."""
        return sorted(((s.step, i) for i, s in enumerate(self.slots) if s.state == COMMITTED), reverse=True)


class SlotTable:
    """Every key's slots on this node, the round's fence and the durable steps; thread-safe."""

    def __init__(self, token: str, memory_limit: int | None = None) -> None:
        self.token = token
        self.memory_limit = memory_limit
        self.cond = threading.Condition()
        self.keys: dict[str, KeySlots] = {}
        self.round: int | None = None
        self.round_open = False
        self.lease_until = 0.0
        self.resume_step: int | None = None
        self.disk_only: str | None = None
        self.durable: dict[str, int] = {}
        self.resumed_at = -RELOAD_PAUSE_SECONDS
        self.fresh = FreshMemory(token, self.cond)
        self.saved_in_round: set[str] = set()  # keys reserved in the open round (the first starts their fresh memory)

    # ------------------------------------------------------------------ the agent's side
    def open_round(self, round_no: int, resume_step: int | None, lease: float) -> None:
        with self.cond:
            self.round, self.round_open, self.resume_step = round_no, True, resume_step
            self.lease_until = time.monotonic() + lease
            self.saved_in_round = set()

    def renew(self, round_no: int, lease: float) -> None:
        with self.cond:
            if round_no == self.round and self.round_open:
                self.lease_until = time.monotonic() + lease

    def close_round(self, round_no: int) -> None:
        with self.cond:
            if round_no == self.round:
                self.round_open = False
            for keyslots in self.keys.values():  # copies under way now never commit
                for slot in keyslots.slots:
                    if slot.state == WRITING:
                        # Its writer (frozen, perhaps) still maps the memfd and may copy on into it
                        # when it runs again: the next save of this slot gets a fresh memfd, unless
                        # the writer aborts this copy first (`abort`).
                        slot.fenced = (slot.writer, slot.step)  # type: ignore[assignment]
                        slot.state, slot.writer, slot.loaded = FREE, None, True

    def memory_steps(self) -> list[int]:
        """Steps every key on this node holds committed (what this node can resume from memory)."""
        with self.cond:
            sets = [{s for s, _ in k.committed()} for k in self.keys.values()]
        return sorted(set.intersection(*sets)) if sets else []

    # ------------------------------------------------------------------ the workers' side
    def _fence(self, round_no: int) -> None:
        if self.round is None or round_no != self.round or not self.round_open:
            raise Refused(
                f"rally: checkpoint refused: this worker belongs to round {round_no}, which is over "
                f"(the node is in round {self.round}); a worker of an ended round may not save"
            )
        if time.monotonic() > self.lease_until:
            raise Refused(
                f"rally: checkpoint refused: round {round_no} is no longer confirmed by its agent (frozen or cut off)"
            )

    def reserve(
        self, conn: int, key: str, step: int, size: int, round_no: int, persist_name: str | None, keep: int,
        spare_newest: bool = False,
    ) -> tuple[int, int]:  # fmt: skip
        """(index, memfd) of a slot for `step` of `key` with room for `size` bytes, marked being written.
        `spare_newest`: rather `NewestBusy` than the newest committed step's slot."""
        if not valid_key(key) or step < 0 or size <= 0:
            raise Refused(f"rally: checkpoint refused: bad request for key {key!r}, step {step}, {size} bytes")
        total = total_memory()
        if total is not None and size > total:
            raise Refused(
                f"rally: checkpoint refused: a copy of {size} bytes is more than this node's memory ({total} bytes)"
            )
        with self.cond:
            while True:
                self._fence(round_no)
                keyslots = self.keys.setdefault(key, KeySlots())
                index = self._choose(keyslots, spare_newest)
                if not self.fresh.preparing((key, index)):
                    break
                if spare_newest and keyslots.slots[index].loaded:  # after a restart: rather skipped than a stall
                    raise NewestBusy("rally: checkpoint skipped: the slot's fresh memory is still being made")
                # wait: short: 50 ms slices while the slot's fresh memfd is made (~0.1 s per 400 MB, one
                # allocation), half made already: cheaper than making another
                self.cond.wait(PREPARE_WAIT_SECONDS)
            slot = keyslots.slots[index]
            if slot.fd is None or slot.loaded or slot.size < size or slot.size > 2 * size:
                prepared = self.fresh.take((key, index), size)
                if prepared is not None:
                    if slot.fd is not None:
                        os.close(slot.fd)
                    slot.fd, slot.size = prepared
                    slot.loaded = False
                else:
                    self._allocate(key, index, size, slot)
            else:  # back to its full size: only the tail cut off at the last commit is new
                self.fresh.discard((key, index))  # prepared for a reload that read the disk instead
                start = slot.length & ~(PAGE - 1)
                os.posix_fallocate(slot.fd, start, slot.size - start)
            keyslots.slots[index] = Slot(WRITING, step, 0, slot.size, slot.fd, conn, persist_name, keep)
            if key not in self.saved_in_round:  # the job trains again: make what this key's other slots lack
                self.saved_in_round.add(key)
                self._prepare_for(key, keyslots, size)  # after this copy has its memory, never before
            return index, slot.fd  # type: ignore[return-value]

    def _choose(self, keyslots: KeySlots, spare_newest: bool = False) -> int:
        candidates = [i for i, s in enumerate(keyslots.slots) if i != keyslots.persisting and s.state != WRITING]
        if not candidates:
            raise Refused("rally: checkpoint refused: another copy of this state is still being written")
        newest = keyslots.committed()[:1]
        preferred = [i for i in candidates if not newest or i != newest[0][1]]
        if spare_newest and not preferred:
            raise NewestBusy("rally: checkpoint skipped: the other copy is being written to disk")
        return (preferred or candidates)[0]

    def _room(self, freed: int) -> int | None:
        """Bytes a new copy may take, once `freed` bytes the holder holds are let go; None: no limit known."""
        held = sum(s.size for k in self.keys.values() for s in k.slots) + self.fresh.held() - freed
        free = available_memory()
        allowed = [
            limit
            for limit in (
                (free + freed) // 2 if free is not None else None,
                self.memory_limit and self.memory_limit - held,
            )
            if limit is not None
        ]
        return min(allowed) if allowed else None

    def _prepare_for(self, key: str, keyslots: KeySlots, size: int) -> None:
        """Fresh memory for each of `key`'s slots that will need it: reloaded, or fenced with a
        writer that did not let go, or never made (a key's first save: the other slot, of this
        save's `size`). Asked at the round's first save of the key, once that save's own slot has
        its memory (made ahead, memory counts against the node's room: it must not take that
        save's), and not when a slot is reloaded or fenced: then the node's cores are the restart's
        (measured: 0.1 s more from an exception to every rank stepping again with it made beside
        the reload)."""
        for index, slot in enumerate(keyslots.slots):
            if slot.loaded and slot.size > 0:
                self._prepare_fresh(key, index, slot.size)
            elif slot.fd is None:
                self._prepare_fresh(key, index, size)

    def _prepare_fresh(self, key: str, index: int, size: int) -> None:
        """Have a fresh memfd made for a slot that will need one, if it fits now (else its save makes it)."""
        room = self._room(0)
        if room is None or size <= room:
            self.fresh.prepare((key, index), size)

    def _allocate(self, key: str, index: int, size: int, slot: Slot) -> None:
        """A fresh memfd of `size` bytes for the slot (the old one let go), its pages taken now."""
        room = self._room(slot.size)
        if room is not None and size > room and self.fresh.drop_all():  # prepared for slots that may never be saved
            room = self._room(slot.size)
        if room is not None and size > room:
            self.disk_only = self._too_small_line(size, room)
            raise ShmTooSmall(self.disk_only)
        if slot.fd is not None:
            os.close(slot.fd)
            slot.fd, slot.size = None, 0
        fd = os.memfd_create(memfd_name(self.token, key, index), os.MFD_CLOEXEC)
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as exc:
            os.close(fd)
            if exc.errno not in (errno.ENOSPC, errno.ENOMEM, errno.EFBIG):
                raise
            self.disk_only = self._too_small_line(size, available_memory() or 0)
            raise ShmTooSmall(self.disk_only) from None
        slot.fd, slot.size, slot.loaded = fd, size, False

    def _too_small_line(self, size: int, room: int) -> str:
        return (
            f"not enough memory for in-memory checkpoints on this node ({size / 1e6:.1f} MB needed per "
            f"copy, {max(room, 0) / 1e6:.1f} MB it may take); such saves go to disk only"
        )

    def release(self) -> None:
        """Let go of every slot's memory (the holder is stopping)."""
        with self.cond:
            self.fresh.stop()
            for keyslots in self.keys.values():
                for slot in keyslots.slots:
                    if slot.fd is not None:
                        os.close(slot.fd)
                        slot.fd = None

    def commit(self, conn: int, key: str, step: int, length: int, round_no: int) -> Slot:
        with self.cond:
            slot = self._writing(conn, key, step)
            try:
                self._fence(round_no)
            except Refused:
                slot.state, slot.writer = FREE, None
                raise
            if not 0 < length <= slot.size:
                slot.state, slot.writer = FREE, None
                raise Refused(f"rally: checkpoint refused: length {length} outside the slot's {slot.size} bytes")
            # The memfd ends where the archive ends, as a file must for torch.load (its zip
            # directory is found from the end); the cut tail is a few pages at most.
            os.ftruncate(slot.fd, length)  # type: ignore[arg-type]
            slot.state, slot.length, slot.writer = COMMITTED, length, None
            self.cond.notify_all()
            return slot

    def copying(self) -> bool:
        """True while some worker is copying into a slot, or may be copying out of one: for
        RELOAD_PAUSE_SECONDS after a resume (the restart the job is waiting for)."""
        with self.cond:
            reloading = time.monotonic() < self.resumed_at + RELOAD_PAUSE_SECONDS
            return reloading or any(s.state == WRITING and not s.copied for k in self.keys.values() for s in k.slots)

    def copied(self, conn: int, key: str, step: int) -> None:
        """The writer's copy into the slot is done; it commits (or aborts) once it knows the copy is
        intact (agent/checkpoint/core/overlap.py): the persister need not pause for it meanwhile."""
        with self.cond:
            try:
                self._writing(conn, key, step).copied = True
            except Refused:
                return  # committed or aborted already

    def abort(self, conn: int, key: str, step: int, ended: bool = False) -> None:
        """`ended`: the writer says its copy is over (see `_unfence`)."""
        with self.cond:
            try:
                slot = self._writing(conn, key, step)
            except Refused:
                if ended:
                    self._unfence(conn, key, step)
                return
            slot.state, slot.writer = FREE, None
            self.cond.notify_all()

    def _unfence(self, conn: int, key: str, step: int) -> None:
        """The writer of a copy a round's end voided aborts it, saying its copy has ended (an
        overlapped save's copy thread, agent/checkpoint/core/overlap.py): nothing of it writes into
        the slot any more, which may be written again. A plain abort may come from a thread that
        was interrupted while others still copy (a sharded save's exchange): it frees nothing."""
        for index, slot in enumerate(self.keys.get(key, KeySlots()).slots):
            if slot.fenced == (conn, step) and slot.state == FREE:
                slot.fenced, slot.loaded = None, False
                self.fresh.discard((key, index))

    def _writing(self, conn: int, key: str, step: int) -> Slot:
        for slot in self.keys.get(key, KeySlots()).slots:
            if slot.state == WRITING and slot.writer == conn and slot.step == step:
                return slot
        raise Refused(f"rally: checkpoint refused: no copy of step {step} under way for {key!r}")

    def writer_gone(self, conn: int) -> None:
        """A worker's connection closed: whatever it was still writing is void (killed mid-copy)."""
        with self.cond:
            for keyslots in self.keys.values():
                for slot in keyslots.slots:
                    if slot.state == WRITING and slot.writer == conn:
                        slot.state, slot.writer = FREE, None
                        self.cond.notify_all()

    def resume(self, key: str) -> tuple[int | None, int | None, int | None]:
        """(the round's agreed step, the slot index and memfd holding it for `key`); the last two
        None when this node does not hold it (read the disk)."""
        with self.cond:
            self.resumed_at = time.monotonic()
            step = self.resume_step
            keyslots = self.keys.get(key)
            if step is None or keyslots is None:
                return step, None, None
            for s, index in keyslots.committed():
                if s == step:
                    keyslots.slots[index].loaded = True
                    return step, index, keyslots.slots[index].fd
            return step, None, None

    def next_slots(self, key: str) -> list[tuple[int, int]]:
        """(index, memfd) of each slot of `key` the next saves may write: a fresh memfd made for a
        reloaded or fenced slot (waited for while it is being made), or a free slot's own. A worker
        maps them on a thread of its own after its round's first save (client.MemoryTier.premap):
        mapping a new memfd's pages costs about as much again as making them, and at a save it is
        a stall."""
        deadline = time.monotonic() + NEXT_SLOTS_WAIT_SECONDS
        with self.cond:
            keyslots = self.keys.get(key)
            if keyslots is None:
                return []
            places = [(key, index) for index in range(len(keyslots.slots))]
            while any(map(self.fresh.preparing, places)) and (left := deadline - time.monotonic()) > 0:
                # wait: background: for the worker's premap thread (nobody waits on it), in 50 ms slices,
                # NEXT_SLOTS_WAIT_SECONDS (5 s) at most
                self.cond.wait(min(left, PREPARE_WAIT_SECONDS))
            found = []
            for index, slot in enumerate(keyslots.slots):
                fd = self.fresh.ready_fd((key, index))
                if fd is None and slot.fd is not None and not slot.loaded and slot.state == FREE:
                    fd = slot.fd  # at its full size (a committed one is cut to its archive's end)
                if fd is not None:
                    found.append((index, fd))
            return found

    def held(self, prefix: str) -> dict[str, list[int]]:
        """Committed steps of every key starting with `prefix` (sharded states: a rank's own
        copy and the ring peer's replica, see agent/checkpoint/sharded/memory.py)."""
        with self.cond:
            return {k: sorted(s for s, _ in ks.committed()) for k, ks in self.keys.items() if k.startswith(prefix)}

    def committed_slot(self, key: str, step: int) -> tuple[int, int] | None:
        """(the memfd holding committed `step` of `key`, its length); None: not in memory here.
        The slot is marked loaded, so the next save into it gets a fresh memfd."""
        with self.cond:
            keyslots = self.keys.get(key)
            if keyslots is None:
                return None
            for s, index in keyslots.committed():
                slot = keyslots.slots[index]
                if s == step and slot.fd is not None:
                    slot.loaded = True
                    return slot.fd, slot.length
            return None

    # ------------------------------------------------------------------ the persister's side
    def next_to_persist(self) -> tuple[str, int, Slot] | None:
        """The newest committed, not yet durable slot of some key; marks it being persisted."""
        with self.cond:  # re-entrant: the holder may hold it already
            for key, keyslots in self.keys.items():
                if keyslots.persisting is not None:
                    continue
                for step, index in keyslots.committed():
                    slot = keyslots.slots[index]
                    if slot.persist_name and not slot.persisted and step > self.durable.get(key, -1):
                        keyslots.persisting = index
                        return key, index, slot
                    break  # only the newest is worth persisting
            return None

    def persisted(self, key: str, index: int, ok: bool) -> None:
        with self.cond:  # re-entrant: the holder may hold it already
            keyslots = self.keys[key]
            keyslots.persisting = None
            slot = keyslots.slots[index]
            slot.persisted = True  # a failed step is not retried: the next save brings a newer one
            if ok:
                self.durable[key] = max(self.durable.get(key, -1), slot.step)
            self.cond.notify_all()

    def pending(self) -> bool:
        """True while some key's newest committed copy still waits to be (or is being) persisted."""
        with self.cond:  # re-entrant: the holder may hold it already
            for key, keyslots in self.keys.items():
                if keyslots.persisting is not None:
                    return True
                newest = keyslots.committed()[:1]
                if newest:
                    slot = keyslots.slots[newest[0][1]]
                    if slot.persist_name and not slot.persisted and slot.step > self.durable.get(key, -1):
                        return True
            return False


def total_memory() -> int | None:
    """The node's physical memory (MemTotal), the bound of any sane request; None when unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def available_memory() -> int | None:
    """Bytes this process may still take: /proc/meminfo's MemAvailable, or less where its cgroup's
    limit (v2 memory.max, v1 memory.limit_in_bytes) is nearer. None when nothing says."""
    found = []
    try:
        with open("/proc/meminfo") as f:
            found += [int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:")]
    except (OSError, ValueError, IndexError):
        pass
    try:
        with open("/proc/self/cgroup") as f:
            lines = [line.rstrip("\n").split(":", 2) for line in f]
    except OSError:
        lines = []
    for _, controllers, path in (line for line in lines if len(line) == 3):
        if controllers == "":
            files = (f"/sys/fs/cgroup{path}/memory.max", f"/sys/fs/cgroup{path}/memory.current")
        elif "memory" in controllers.split(","):
            files = (
                f"/sys/fs/cgroup/memory{path}/memory.limit_in_bytes",
                f"/sys/fs/cgroup/memory{path}/memory.usage_in_bytes",
            )
        else:
            continue
        try:
            limit, used = (Path(name).read_text().strip() for name in files)
            if limit.isdigit() and int(limit) < 1 << 60:
                found.append(int(limit) - int(used))
        except (OSError, ValueError):
            continue
    return max(0, min(found)) if found else None
