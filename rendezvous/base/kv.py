"""The key-value store interface the round protocol runs on, and the errors every store raises.

`rendezvous/protocol.py` needs from a store only what `KeyValueStore` declares: plain and
signed keys, first-wins keys, counters, waits, a second connection for a thread that blocks.
A c10d store (`rendezvous/c10d/store.Store`: TCPStore, FileStore) and etcd
(`rendezvous/etcd/store.EtcdStore`) implement it; a new backend implements it too and
registers in `rendezvous/backends.py`. What is common to every store (`try_wait`) is written
here once.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import ClassVar, Protocol, runtime_checkable

from rally.rendezvous.base.token import Signer

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


# A key's checked value, or why it is not one: a value this job did not write is its UntrustedValue,
# so in a read of many keys one stranger's key hides none of the others.
Checked = bytes | UntrustedValue


@dataclass(frozen=True)
class Seen:
    """What one read found: `values`, the checked value of each key that exists, by name; `at`,
    where the store can say it, the point of the store's history the read saw (etcd: the
    revision), so that a wait for a key it found absent starts there without reading again
    (`KeyValueStore.wait_and_read`'s `since`). None on c10d, which has no such point."""

    values: dict[str, Checked] = field(default_factory=dict)
    at: int | None = None


def opened(value: Checked) -> bytes:
    """A checked value's payload: raises its UntrustedValue when it is one."""
    if isinstance(value, UntrustedValue):
        raise value
    return value


def opened_text(value: Checked, key: str) -> str:
    """`opened` as text (`key`, the store key, named when the bytes are not text), as `get_str` reads."""
    try:
        return opened(value).decode()
    except UnicodeDecodeError:
        raise UntrustedValue(f"store key '{key}' holds bytes that are not text") from None


class StoreReader(Protocol):
    """What reading a job's status needs of a store (rendezvous/status/reader.py): every
    `KeyValueStore`, and the torch-free c10d reader of `rally status` (rendezvous/c10d/wire.py)."""

    prefix: str
    signer: Signer

    def key(self, name: str) -> str: ...

    def get_if_present(self, name: str, *, nobody_waits: bool = False) -> bytes | None: ...

    def get_unsigned(self, name: str) -> bytes | None: ...

    def counter(self, name: str, limit: int | None = None) -> int: ...


class KeyValueStore(ABC):
    """One connection to a rendezvous store, every key under `prefix`.

    Guarantees every implementation gives: a timed-out wait raises `StoreTimeout`, a lost or
    refused store `StoreUnavailable` (with `describe`, what messages call the store, in the
    text), a value this job did not write `UntrustedValue` naming the key. `get` and
    `multi_get` block until their keys exist, as a c10d store's do.

    Every read returns what it read: a key that may not exist is read with `get_if_present`
    (or `read_present` for several), a wait that is followed by a read is `wait_and_read`. The
    protocol never pairs a `check` with a `get` itself: where a store needs two requests for such
    a read (c10d, for a key somebody waits for), the pair is inside the store and its docstring
    says so, and a store that reads in one request (etcd) does.
    """

    prefix: str
    describe: str
    signer: Signer  # signs what this connection writes, checks what it reads (rendezvous/base/token.py)
    # None: a value this job did not write raises UntrustedValue. Set (by a running job's agent,
    # on a store whose `replaces_untrusted` is True: c10d): such a value in a counter or a
    # first-wins key is replaced and this is called with one line naming the key, so a stranger's
    # garbage write ends nothing.
    on_untrusted: Callable[[str], None] | None = None
    replaces_untrusted: ClassVar[bool] = False

    @property
    def leased_liveness(self) -> bool:
        """Keep-alives are counters watched in a ring, unless the store's keys can expire by
        themselves (etcd leases): a store that offers `LeasedStore` (below) keeps them as leases."""
        return isinstance(self, LeasedStore)

    def key(self, name: str) -> str:
        return f"{self.prefix}{name}"

    @abstractmethod
    def set(self, name: str, value: str | bytes) -> None: ...

    @abstractmethod
    def get(self, name: str) -> bytes: ...

    @abstractmethod
    def get_str(self, name: str) -> str: ...

    @abstractmethod
    def get_unsigned(self, name: str) -> bytes | None:
        """The raw bytes of a list key written by `append` (unsigned), None when nobody appended."""

    @abstractmethod
    def check(self, name: str) -> bool:
        """Whether the key exists (only for that: a value that is wanted is read with `get_if_present`)."""

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
    def get_if_present(self, name: str, *, nobody_waits: bool = False) -> bytes | None:
        """The checked value of `name`, or None when it does not exist (never a wait; a value this
        job did not write raises UntrustedValue). `nobody_waits`: no node waits for the key while
        it is absent (a node's assignment), which lets c10d read it in one request
        (`Store.get_if_present`); etcd reads any key in one."""

    @abstractmethod
    def wait_and_read(
        self, names: Sequence[str], timeout: float, *, also: Sequence[str] = (), since: Seen | None = None
    ) -> dict[str, Checked] | None:
        """Block until every key of `names` exists, then their checked values by name; None after
        `timeout` seconds. `also`: keys written just before `names` whose values the store returns
        too where it reads them on the side (etcd: on the same watch; c10d: never), so a read of
        them after the wait can be skipped. `since`: a read just made that found `names` absent
        (`read_now`, `Arrival.seen`): a store that can wait from the point it saw (etcd) does so
        without reading again."""

    @abstractmethod
    def connect_again(self) -> KeyValueStore:
        """A second connection to the same store, for a thread that blocks in `wait`."""

    def arrive(self, name: str) -> int:
        """This caller's 0-based place in the arrival order of `name`: `add` one to a counter. On
        etcd an increment by one is a key of its own, one request whoever else arrives at once
        (etcd/store.py, `EtcdStore.add`)."""
        return self.add(name, 1) - 1

    def get_present(self, names: Sequence[str]) -> dict[str, Checked]:
        """The checked values of those of `names` that exist, by name: how the closer reads every
        node descriptor when its wait for all of them ran out. One wait that finds them all (else
        `read_present`); a store that reads many keys in one request overrides this (etcd: one
        range, `EtcdStore.get_present`).
        """
        # wait: short: PRESENT_PROBE_SECONDS (0.01 s)
        found = self.wait_and_read(names, PRESENT_PROBE_SECONDS)
        return self.read_present(names) if found is None else found

    def read_each(self, names: Sequence[str]) -> dict[str, Checked]:
        """The checked values of `names`, which all exist, each on its own: one `get` per key here;
        one request where the store reads many keys at once (c10d: `multi_get`, `Store.read_each`)."""
        values: dict[str, Checked] = {}
        for name in names:
            try:
                values[name] = self.get(name)
            except UntrustedValue as exc:
                values[name] = exc
        return values

    def read_present(self, names: Sequence[str]) -> dict[str, Checked]:
        """The checked values of those of `names` that exist now (never a wait): a `check` each and
        one `read_each` of those found here (c10d: N checks and one `multi_get`), one request on
        etcd (`EtcdStore.read_present`). For a few keys that mostly do not exist (the end records a
        node checks before it joins), where `get_present` would wait."""
        return self.read_each([name for name in names if self.check(name)])

    def read_now(self, names: Sequence[str]) -> Seen:
        """`read_present`, with the point of the store's history it read at where the store has one
        (etcd), so that a `wait_and_read` for the keys it found absent starts there (`since`)."""
        return Seen(self.read_present(names))

    def counter_and_present(self, counter: str, limit: int, names: Sequence[str]) -> tuple[int, dict[str, Checked]]:
        """`counter(counter, limit)` and `read_present(names)`: a joining node's first look at the
        job (the `current` hint and the end records), one request where the store can (etcd)."""
        return self.counter(counter, limit), self.read_present(names)

    def all_present(self, names: Sequence[str]) -> bool:
        """Whether every key of `names` exists now (never a wait): a `check` each here, stopping at
        the first absent one; one request on c10d (`Store.all_present`) and etcd (`read_present`)."""
        return all(self.check(name) for name in names)

    def try_wait(self, names: Sequence[str], timeout: float) -> bool:
        """`wait`, answering False instead of raising when the time is up."""
        try:
            # wait: slice: the caller's timeout
            self.wait(names, timeout)
            return True
        except StoreTimeout:
            return False


# ------------------------------------------------------------------ optional capabilities
# A store offers more than KeyValueStore by having a capability's methods; the protocol asks
# `isinstance(store, Capability)`, and nothing else says what a store can do.


@runtime_checkable
class LeasedStore(Protocol):
    """Keys that expire by themselves (etcd's leases): keep-alives as leased keys instead of counters
    watched in a ring (rendezvous/round_channel.py, agent/rounds/leased_liveness.py)."""

    def grant_lease(self, ttl: float) -> int: ...

    def refresh_lease(self, lease: int) -> bool: ...

    def set_leased(self, name: str, value: str, lease: int) -> None: ...

    def wait_deleted(self, name: str, timeout: float) -> bool: ...


@runtime_checkable
class OrderedArrivals(Protocol):
    """A store that orders a counter's increments itself and lets each hold a value (etcd:
    `EtcdStore.arrive_holding`, `arrivals`, `wait_arrival`): an arrival is one request
    (rendezvous/arrival.py)."""

    def arrive_holding(self, counter: str, value: str, also: str) -> tuple[int, int, Seen]: ...

    def arrive_if_fresh(
        self, counter: str, value: str, also: str, hint: str, limit: int, ends: Sequence[str]
    ) -> tuple[tuple[int, int, Seen] | None, int, dict[str, Checked]]: ...

    def arrivals(self, counter: str, limit: int) -> tuple[int, list[tuple[int, Checked]]]: ...

    def wait_arrival(self, counter: str, after: int, timeout: float) -> bool: ...
