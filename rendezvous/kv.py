"""The key-value store interface the round protocol runs on, and the errors every store raises.

`rendezvous/protocol.py` needs from a store only what `KeyValueStore` declares: plain and
signed keys, first-wins keys, counters, waits, a second connection for a thread that blocks.
A c10d store (`rendezvous/store.Store`: TCPStore, FileStore) and etcd
(`rendezvous/etcd_store.EtcdStore`) implement it; a new backend implements it too and
registers in `rendezvous/backends.py`. What is common to every store (`try_wait`) is written
here once.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import ClassVar, Protocol

from rally.rendezvous.token import Signer

# `get_present` first waits this long for all its keys: one call when they exist (as they do
# after the closer's own wait), a short pause when some never will.
PRESENT_PROBE_SECONDS = 0.01


class StoreError(Exception):
    """Base of store failures that the agent turns into a readable reason."""


class StoreTimeout(StoreError):
    """A wait or get did not see its keys in time; the store itself is fine."""


class StoreUnavailable(StoreError):
    """The store cannot be reached (never was, or its host died)."""


class UntrustedValue(StoreError):
    """A key holds a value this job did not write, or one out of range; the message names the key."""


class StoreTampered(UntrustedValue):
    """A record that must exist is gone: something deleted it (never read as a zero). Exit 1."""


class EndpointError(ValueError):
    """A store endpoint that cannot work; the message is one line for the user."""


class StoreReader(Protocol):
    """What reading a job's status needs of a store (rendezvous/status.py): every
    `KeyValueStore`, and the torch-free c10d reader of `rally status` (rendezvous/wire_store.py)."""

    prefix: str
    signer: Signer

    def key(self, name: str) -> str: ...

    def check(self, name: str) -> bool: ...

    def get(self, name: str) -> bytes: ...

    def get_unsigned(self, name: str) -> bytes: ...

    def counter(self, name: str, limit: int | None = None) -> int: ...


class KeyValueStore(ABC):
    """One connection to a rendezvous store, every key under `prefix`.

    Guarantees every implementation gives: a timed-out wait raises `StoreTimeout`, a lost or
    refused store `StoreUnavailable` (with `describe`, what messages call the store, in the
    text), a value this job did not write `UntrustedValue` naming the key. `get` and
    `multi_get` block until their keys exist, as a c10d store's do.
    """

    prefix: str
    describe: str
    signer: Signer  # signs what this connection writes, checks what it reads (rendezvous/token.py)
    # None: a value this job did not write raises UntrustedValue. Set (by a running job's agent,
    # on a store whose `replaces_untrusted` is True: c10d): such a value in a counter or a
    # first-wins key is replaced and this is called with one line naming the key, so a stranger's
    # garbage write ends nothing.
    on_untrusted: Callable[[str], None] | None = None
    replaces_untrusted: ClassVar[bool] = False
    # Keep-alives are counters watched in a ring, unless the store's keys can expire by
    # themselves (etcd leases): then it offers grant_lease / set_leased / wait_deleted instead.
    leased_liveness: ClassVar[bool] = False

    def key(self, name: str) -> str:
        return f"{self.prefix}{name}"

    @abstractmethod
    def set(self, name: str, value: str | bytes) -> None: ...

    @abstractmethod
    def get(self, name: str) -> bytes: ...

    @abstractmethod
    def get_str(self, name: str) -> str: ...

    @abstractmethod
    def get_unsigned(self, name: str) -> bytes: ...

    @abstractmethod
    def check(self, name: str) -> bool: ...

    @abstractmethod
    def add(self, name: str, amount: int) -> int: ...

    @abstractmethod
    def counter(self, name: str, limit: int | None = None) -> int: ...

    @abstractmethod
    def append(self, name: str, value: str) -> None: ...

    @abstractmethod
    def set_once(self, name: str, value: str) -> tuple[bool, str]: ...

    @abstractmethod
    def multi_get(self, names: Sequence[str]) -> list[bytes]: ...

    @abstractmethod
    def multi_set(self, items: dict[str, str]) -> None: ...

    @abstractmethod
    def wait(self, names: Sequence[str], timeout: float) -> None:
        """Block until every key exists (raises StoreTimeout after `timeout` seconds)."""

    @abstractmethod
    def connect_again(self) -> KeyValueStore:
        """A second connection to the same store, for a thread that blocks in `wait`."""

    def arrive(self, name: str) -> int:
        """This caller's 0-based place in the arrival order of `name`: `add` one to a counter. On
        etcd an increment by one is a key of its own, one request whoever else arrives at once
        (etcd_store.EtcdStore.add)."""
        return self.add(name, 1) - 1

    def get_present(self, names: Sequence[str]) -> dict[str, bytes | UntrustedValue]:
        """The checked values of those of `names` that exist, by name: how the closer reads every
        node descriptor. A value this job did not write is its `UntrustedValue`, so one
        stranger's key hides none of the others. One wait that finds them all (else a `check`
        each), then `read_each` (one `multi_get` on c10d); a store that reads many keys in one
        request overrides this (etcd: one range, `EtcdStore.get_present`).
        """
        # wait: short: PRESENT_PROBE_SECONDS (0.01 s)
        if self.try_wait(names, PRESENT_PROBE_SECONDS):
            return self.read_each(names)
        return self.read_each([name for name in names if self.check(name)])

    def read_each(self, names: Sequence[str]) -> dict[str, bytes | UntrustedValue]:
        """The checked values of `names`, which all exist, each on its own (a value this job did not
        write is its `UntrustedValue`): one `get` per key here; one request where the store reads
        many keys at once (c10d: `multi_get`, `Store.read_each`)."""
        values: dict[str, bytes | UntrustedValue] = {}
        for name in names:
            try:
                values[name] = self.get(name)
            except UntrustedValue as exc:
                values[name] = exc
        return values

    def read_present(self, names: Sequence[str]) -> dict[str, bytes | UntrustedValue]:
        """The checked values of those of `names` that exist now (never a wait; a value this job did
        not write is its `UntrustedValue`): a `check` and a `get` each here, one request on etcd
        (`EtcdStore.read_present`). For a few keys that mostly do not exist (the end records a
        node checks before it joins), where `get_present` would wait."""
        return self.read_each([name for name in names if self.check(name)])

    def counter_and_present(
        self, counter: str, limit: int, names: Sequence[str]
    ) -> tuple[int, dict[str, bytes | UntrustedValue]]:
        """`counter(counter, limit)` and `read_present(names)`: a joining node's first look at the
        job (the `current` hint and the end records), one request where the store can (etcd)."""
        return self.counter(counter, limit), self.read_present(names)

    def get_if_present(self, name: str) -> bytes | None:
        """The checked value of `name`, or None when it does not exist (never a wait): a `check`
        and a `get` here, one request where the store can (`Store.get_if_present`). Only for keys
        nobody waits for while they are absent (a node's assignment): on c10d the request wakes
        such waiters (see `Store.get_if_present`)."""
        return self.get(name) if self.check(name) else None

    def also_watch(self, name: str) -> None:
        """A hint: `name` (a key written just before the one the next wait is for) will be read right
        after that wait. A store that can watch it on the same stream keeps its value then (etcd:
        `EtcdStore.also_watch`); here, nothing."""
        return None

    def try_wait(self, names: Sequence[str], timeout: float) -> bool:
        """`wait`, answering False instead of raising when the time is up."""
        try:
            # wait: slice: the caller's timeout
            self.wait(names, timeout)
            return True
        except StoreTimeout:
            return False
