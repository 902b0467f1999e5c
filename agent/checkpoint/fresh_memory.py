"""Slot memory made ready in the background, before the save that needs it asks.

A slot a worker reloaded, or one fenced mid-copy, is never written again (agent/checkpoint/slots.py):
the next save into it gets a fresh memfd, and taking a fresh memfd's pages (`posix_fallocate`,
the kernel zeroing them) costs ~0.1 s per 400 MB on a quiet machine here and several times that
while the node's other ranks train beside it. Every restart makes such slots (the resumed step's,
and the one a killed worker was writing), so the first two saves of every round used to stall on
it, and a job that sizes its checkpoint interval from what saves cost (Young's formula) then saved
rarely for its first seconds, just when the next fault is as likely as ever.

So the table asks for the fresh memfds a key's slots lack at the round's first save of that key
(agent/checkpoint/slots.py `_prepare_for`): once the job trains again, not during the restart,
whose cores are the workers'. One thread allocates them (outside the table's lock: requests go on
meanwhile), and the save that comes for a slot takes its memfd ready. A save that comes while it
is still being made is skipped if it is an overlapped save of a restarted slot (the newest step
stays), and otherwise waits for it rather than make another.

Prepared memory is the holder's like any slot's: it counts against the node's limits when it is
asked for (not asked for when it would not fit), and it is given back when the table needs the room
for a real copy (`drop_all`) or the slot turns out not to need it (the worker read the disk).
"""

from __future__ import annotations

import os
import threading
from collections import deque

from rally.agent.checkpoint.core.shm import memfd_name

Place = tuple[str, int]  # (key, slot index)


class FreshMemory:
    """memfds made ready for slots, by one background thread; every method but the thread's own
    is called with the table's condition held (`cond`)."""

    def __init__(self, token: str, cond: threading.Condition) -> None:
        self.token = token
        self.cond = cond
        self.ready: dict[Place, tuple[int, int]] = {}  # place -> (memfd, bytes)
        self.pending: dict[Place, int] = {}  # place -> bytes being allocated
        self.queue: deque[Place] = deque()
        self.thread: threading.Thread | None = None
        self.stopping = False

    def prepare(self, place: Place, size: int) -> None:
        """Have a memfd of `size` bytes made for `place`, unless one is (being) made already."""
        if self.stopping or size <= 0 or self.pending.get(place) == size:
            return
        ready = self.ready.get(place)
        if ready is not None and ready[1] == size:
            return
        self.discard(place)
        self.pending[place] = size
        self.queue.append(place)
        if self.thread is None:
            self.thread = threading.Thread(target=self._allocator, name="rally-fresh-slots", daemon=True)
            self.thread.start()
        self.cond.notify_all()

    def preparing(self, place: Place) -> bool:
        return place in self.pending

    def ready_fd(self, place: Place) -> int | None:
        """The memfd made for `place`, if one is ready (it stays the holder's till `take`)."""
        ready = self.ready.get(place)
        return ready[0] if ready is not None else None

    def take(self, place: Place, size: int) -> tuple[int, int] | None:
        """(memfd, bytes) made for `place` when it suits a copy of `size` bytes (at least that
        much, at most twice: a slot's own rule); None otherwise (an unsuitable one is let go)."""
        ready = self.ready.pop(place, None)
        if ready is None:
            return None
        if size <= ready[1] <= 2 * size:
            return ready
        os.close(ready[0])
        return None

    def discard(self, place: Place) -> None:
        """`place` needs no fresh memory after all: let go of what was made or is being made for it."""
        self.pending.pop(place, None)  # the thread closes what it finds no longer wanted
        ready = self.ready.pop(place, None)
        if ready is not None:
            os.close(ready[0])

    def drop_all(self) -> int:
        """Let go of every prepared memfd (the table needs the room for a copy); the bytes given back."""
        freed = sum(size for _, size in self.ready.values())
        for place in list(self.ready):
            self.discard(place)
        return freed

    def held(self) -> int:
        """Bytes prepared or being prepared (they count as the holder's memory)."""
        return sum(size for _, size in self.ready.values()) + sum(self.pending.values())

    def stop(self) -> None:
        self.stopping = True
        self.pending.clear()
        self.drop_all()
        self.cond.notify_all()

    def _allocator(self) -> None:
        while True:
            with self.cond:
                while not self.queue and not self.stopping:
                    # wait: background: the allocator thread, idle till a slot needs fresh memory, in 1 s
                    # slices; it ends when the holder stops
                    self.cond.wait(1.0)
                if self.stopping:
                    return
                place = self.queue.popleft()
                size = self.pending.get(place)
            if size is None:
                continue  # discarded before its turn
            fd: int | None = None
            try:
                fd = os.memfd_create(memfd_name(self.token, *place), os.MFD_CLOEXEC)
                os.posix_fallocate(fd, 0, size)
            except OSError:  # no room now: the save allocates itself, and says what is wrong
                if fd is not None:
                    os.close(fd)
                fd = None
            with self.cond:
                if fd is not None and self.pending.get(place) == size and not self.stopping:
                    self.ready[place] = (fd, size)
                elif fd is not None:
                    os.close(fd)  # discarded, or asked again for another size, meanwhile
                if self.pending.get(place) == size:
                    del self.pending[place]
                self.cond.notify_all()
