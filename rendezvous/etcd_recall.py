"""What an etcd client thread's previous request read, kept so that the read the protocol makes
next costs no request of its own (used by rendezvous/etcd_store.py).

The protocol reads a key as check-then-get, and the closer as wait-then-get of every node's
descriptor: served from the read just made, that is one request per node fewer, and not N
requests in a row for the closer. A `check` that found a key absent leaves the revision it read
at, so that a wait for that key right after is only a watch from there: absence at a revision
never goes stale, and etcd replays whatever was written since.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

# How long a `check` that found a key absent may start a watch on it: a watch from far back
# makes etcd replay everything written since.
ABSENCE_SECONDS = 5.0


class JustRead(threading.local):
    """Per thread: the kvs the previous `check` or `wait` read (until the next request), and the
    revision the latest `check` found a key absent at (until used, or ABSENCE_SECONDS)."""

    def __init__(self) -> None:
        self.kvs: dict[str, dict] = {}
        self.checked: tuple[str, dict] | None = None
        self.absent: tuple[str, int, float] | None = None
        self.fresh_absence: str | None = None  # a key the previous request found absent (`absent_now`)
        self.expected: str | None = None  # a key the next wait watches too (`EtcdStore.also_watch`)

    def forget(self) -> None:
        """A new request ends what `recall` hands out (an absence stays: it cannot go stale)."""
        self.kvs, self.checked, self.fresh_absence = {}, None, None

    def remember(self, kvs: dict[str, dict], checked: tuple[str, dict] | None = None) -> None:
        self.kvs, self.checked = kvs, checked

    def recall(self, name: str, for_check: bool = False) -> dict | None:
        """The key as the previous call read it, if that call was a `check` or a `wait` that saw
        it and no request has been made since; then `get` needs no request, nor does a first
        `check` after a `wait` (it leaves the value for the `get`; a second `check` asks etcd
        again, so a loop of checks never spins on a stale answer). The value handed out is the
        one read a moment earlier; the keys read this way are written once (round records,
        assignments, descriptors, the round's master) or are status records where a moment does
        not matter."""
        if for_check:
            kv = self.kvs.pop(name, None)
            if kv is not None:
                self.checked = (name, kv)
            return kv
        if self.checked and self.checked[0] == name:
            kv, self.checked = self.checked[1], None
            return kv
        return self.kvs.pop(name, None)

    def take(self, names: Sequence[str]) -> dict[str, dict] | None:
        """Every one of `names` as the previous `wait` read them, or None if it did not read them all."""
        if not names or not all(n in self.kvs for n in names):
            return None
        return {n: self.kvs.pop(n) for n in names}

    def remember_absent(self, name: str, revision: int, fresh: bool = False) -> None:
        """`name` did not exist at `revision`: a wait on it right after can watch from there;
        `fresh`: the key was read on the side of another request (an arrival), so the `check` that
        follows it before any other request is answered from it too (`absent_now`)."""
        self.absent = (name, revision, time.monotonic())
        self.fresh_absence = name if fresh else None

    def absent_now(self, name: str) -> bool:
        """Whether the previous request found `name` absent on the side (used once, like `recall`)."""
        fresh, self.fresh_absence = self.fresh_absence, None
        return fresh == name

    def absent_since(self, name: str) -> int | None:
        """The revision a recent `check` found `name` absent at (used once), or None."""
        absent, self.absent = self.absent, None
        if absent and absent[0] == name and time.monotonic() - absent[2] < ABSENCE_SECONDS:
            return absent[1]
        return None
