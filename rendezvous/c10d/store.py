"""c10d key-value stores, wrapped so the rest of rally speaks seconds and clear exceptions.

rally uses torch's own stores (`TCPStore`, `FileStore`) so that a rally job needs nothing
that torch does not already ship. This module hides three awkward corners of them:

* timeouts are `timedelta`s and a timed-out `wait` raises the same `DistStoreError` as other
  faults; here a timeout is `StoreTimeout` and a lost connection is `StoreUnavailable`;
* a client blocked in `wait` blocks every other call on the same connection, so each
  thread that waits gets its own connection (`Store.connect_again`);
* the C++ side logs a warning with a stack trace for every timed-out wait, which is a normal
  event in a rendezvous; the agent silences it with TORCH_CPP_LOG_LEVEL (see `quiet_torch_logs`);
* a store that is not one (a hostile service on the port) must cost one line, never a traceback
  or a hang: torch's client turns a reply that claims a 1 TiB value into `std::bad_alloc`
  (MemoryError here), and waits for ever for the answer to a wait's CANCEL_WAIT. Every error of
  torch's client is `StoreUnavailable` with one line (`Store._call`), and the calls that wait on
  the server (wait, get, multi_get: torch's get waits first) run in another thread, bounded by
  their timeout plus `op_timeout` (`Store._bounded_call`): the connection's long-lived
  `CallRunner`, not a thread started per call.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any, ClassVar

from rally.rendezvous.base.kv import (
    Checked,
    KeyValueStore,
    Seen,
    StoreError,
    StoreTampered,
    StoreTimeout,
    StoreUnavailable,
    UntrustedValue,
)
from rally.rendezvous.base.token import BadRecord, Signer
from rally.rendezvous.c10d.connect import (
    CONSTRUCTOR_SLACK_SECONDS,
    CallRunner,
    NoStoreThere,
    bounded,
    current_progress,
    wait_for_store,
)
from rally.rendezvous.c10d.port_owner import Listener, listener_owners

if TYPE_CHECKING:  # torch is imported lazily: `rally --help` and bad input must not pay 2 s for it.
    from torch.distributed import Store as TorchStore
    from torch.distributed import TCPStore


# The key a `rally store` process writes, so an agent on the same host can tell it from a stranger:
# plain, it is joined only when the port's listener is the agent's own user's or root's; signed
# with the job token (`rally store` run with RALLY_JOB_TOKEN), it proves the store is the job's.
SERVICE_MARKER_KEY = "rally/store-service"
SERVICE_MARKER_VALUE = "rally store"
# The key (under the job's prefix) the agent that hosts the job's store writes, signed.
HOST_MARKER_NAME = "host"
# How long an agent that found the endpoint's port taken waits for the hosting agent's marker.
HOST_MARKER_WAIT_SECONDS = 10.0
# The expected value of `Store.get_if_present`'s compare_set: never a sealed value (those start
# with token.ENVELOPE_TAG), so the compare never matches and the call only reads.
ABSENT = b"\x00rally: no such key\x00"
# How many times a counter or first-wins key a stranger keeps filling with garbage is replaced.
REPAIR_ATTEMPTS = 3
# The slices of that wait: between them, a store hosted by another job is recognised by its marker.
MARKER_SLICE_SECONDS = 0.25
# A Store's `op_timeout` when its maker does not say (torch's own default, 300 s).
DEFAULT_OP_TIMEOUT = 300.0
# Where every job's keys live (rendezvous/protocol.py's job_prefix: rally/<run id>/).
RALLY_KEY_ROOT = "rally/"


def quiet_torch_logs() -> None:
    """Silence c10d's per-timeout C++ warnings in this process (workers keep their own setting).

    Must run before torch is imported. Only sets the level when the user has not chosen one.
    """
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "FATAL")
    # A TCPStore client reverse-resolves its peer; where the resolver drops queries this
    # stalls a connect for 5 s (see DESIGN.md). One short attempt is enough for a log line.
    os.environ.setdefault("RES_OPTIONS", "timeout:1 attempts:1")


def _seconds(value: float) -> timedelta:
    return timedelta(seconds=max(value, 0.001))


__all__ = [
    "Store",
    "StoreEndpoint",
    "StoreError",
    "StoreTampered",
    "StoreTimeout",
    "StoreUnavailable",
    "UntrustedValue",
]


@dataclass
class Store(KeyValueStore):
    """One connection to a c10d store, with every key under `prefix`.

    `describe` is what error messages call the store, e.g. "the rendezvous store at node1:29400".
    """

    raw: TorchStore
    prefix: str
    describe: str
    _reconnect: Callable[[], TorchStore]
    signer: Signer = field(default_factory=Signer)
    on_untrusted: Callable[[str], None] | None = None  # see KeyValueStore; copied by connect_again
    op_timeout: float = DEFAULT_OP_TIMEOUT  # the client's own timeout: how long an answer may take
    replaces_untrusted: ClassVar[bool] = True
    # makes the calls that wait on the server (`_bounded_call`); its thread leaves with this Store
    _runner: CallRunner = field(default_factory=CallRunner, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        weakref.finalize(self, self._runner.close)

    def _bounded_call(self, fn: Callable, args: tuple, waits: float) -> Any:
        """A call that waits on the server for up to `waits` seconds (torch's wait, get, multi_get):
        in the runner's thread, given `waits` + `op_timeout` in all. torch's client sends CANCEL_WAIT when its
        wait times out and then waits for ever for the answer, so a store that never gives it would
        hang the agent; past the bound this connection is dropped for a fresh one and the call is
        StoreUnavailable with one line. (A store that answers nothing at all is said sooner by the
        agent's probe on a connection of its own, at read_timeout: agent/rounds/threads.py.)"""
        bound = waits + self.op_timeout
        try:
            # wait: bounded, said by the caller: the call's own timeout + op_timeout, then StoreUnavailable
            return self._runner.call(lambda: self._call(fn, *args), bound, f"a request to {self.describe}")
        except NoStoreThere:
            runner, self._runner = self._runner, CallRunner()  # the stuck call keeps the old runner's thread
            weakref.finalize(self, self._runner.close)
            runner.close()
            try:
                self.raw = self._reconnect()  # the stuck call keeps the old connection (and its lock)
            except Exception:  # the store is gone too: the line below says what matters
                pass
            raise StoreUnavailable(
                f"{self.describe} did not answer a wait (or its cancel) within {bound:g} s: what listens there is a "
                "stalled or hostile store"
            ) from None

    def _call(self, fn: Callable, *args):
        from torch.distributed import DistNetworkError, DistStoreError

        try:
            return fn(*args)
        except DistNetworkError as exc:
            raise StoreUnavailable(f"{self.describe} is gone ({_first_line(exc)})") from exc
        except DistStoreError as exc:
            if "timeout" in str(exc).lower():
                raise StoreTimeout(_first_line(exc)) from exc
            raise StoreUnavailable(f"{self.describe} failed: {_first_line(exc)}") from exc
        except RuntimeError as exc:  # FileStore reports everything as RuntimeError
            if "timeout" in str(exc).lower():
                raise StoreTimeout(_first_line(exc)) from exc
            raise StoreUnavailable(f"{self.describe} failed: {_first_line(exc)}") from exc
        except MemoryError:  # torch's std::bad_alloc: a reply that claims a value too large to hold
            raise StoreUnavailable(
                f"{self.describe} sent a reply no store sends (a value too large to hold in memory): what listens "
                "there is not a c10d store, or a hostile one"
            ) from None
        except Exception as exc:  # anything else torch's client or its bindings raise on a strange reply
            raise StoreUnavailable(
                f"{self.describe} sent a reply no store sends ({type(exc).__name__}: {_first_line(exc)[:200]})"
            ) from exc

    def _seal(self, name: str, value: str | bytes) -> bytes:
        return self.signer.seal(self.key(name), value)

    def _open(self, name: str, sealed: bytes) -> bytes:
        try:
            return self.signer.open(self.key(name), sealed)
        except BadRecord as exc:
            raise UntrustedValue(str(exc)) from None

    def set(self, name: str, value: str | bytes) -> None:
        """Write a signed value (see rendezvous/base/token.py); `get` checks the signature."""
        self._call(self.raw.set, self.key(name), self._seal(name, value))

    def get(self, name: str) -> bytes:
        return self._open(name, self._bounded_call(self.raw.get, (self.key(name),), self.op_timeout))

    def get_str(self, name: str) -> str:
        try:
            return self.get(name).decode()
        except UnicodeDecodeError:
            raise UntrustedValue(f"store key '{self.key(name)}' holds bytes that are not text") from None

    def add(self, name: str, amount: int) -> int:
        """Add to a counter. Counters cannot be signed; a stranger who `set` one to text makes
        the server drop the connection, which is told apart here from a lost store. With
        `on_untrusted` set, such garbage is reset to 0 (counters are hints: slots and signed
        records decide) and the add is tried again."""
        for _attempt in range(REPAIR_ATTEMPTS):
            try:
                return int(self._call(self.raw.add, self.key(name), amount))
            except StoreUnavailable:
                value = self._read_after_reconnect(name)
                if value is None:
                    raise
                line = (
                    f"store key '{self.key(name)}' holds {value[:40]!r}, not a counter (garbage written by a stranger)"
                )
                if self.on_untrusted is None:
                    raise UntrustedValue(line) from None
                self._call(self.raw.compare_set, self.key(name), value, b"0")
                self.on_untrusted(line + "; reset to 0, the job goes on")
        raise UntrustedValue(f"store key '{self.key(name)}' is rewritten with garbage again and again (a stranger)")

    def _read_after_reconnect(self, name: str) -> bytes | None:
        """The raw value of `name` over a fresh connection, or None when the store is gone."""
        try:
            self.raw = self._reconnect()
            if not self.raw.check([self.key(name)]):
                return None
            return self._bounded_call(self.raw.get, (self.key(name),), self.op_timeout)
        except Exception:  # the store is really gone: the caller re-raises
            return None

    def counter(self, name: str, limit: int | None = None) -> int:
        """A counter's value, checked to lie in 0..limit (strangers can `add` any amount)."""
        value = self.add(name, 0)
        if value < 0 or (limit is not None and value > limit):
            bound = "" if limit is None else f" (at most {limit})"
            raise UntrustedValue(
                f"store key '{self.key(name)}' holds {value}, out of range{bound}: a stranger wrote to the store"
            )
        return value

    def check(self, name: str) -> bool:
        return bool(self._call(self.raw.check, [self.key(name)]))

    def all_present(self, names: Sequence[str]) -> bool:
        """Every key of `names` exists: one CHECK request of them all (c10d answers for the set)."""
        return bool(self._call(self.raw.check, [self.key(name) for name in names])) if names else True

    def get_unsigned(self, name: str) -> bytes | None:
        """The raw bytes of a key written by `append` (which cannot be signed), None when nobody
        appended: a `check` and a `get`, two requests (a c10d `get` of an absent key blocks)."""
        return self._bounded_call(self.raw.get, (self.key(name),), self.op_timeout) if self.check(name) else None

    def append(self, name: str, value: str) -> None:
        """Append to a list key (unsigned: only `rally status` reads it, and checks each record)."""
        self._call(self.raw.append, self.key(name), value)  # type: ignore[attr-defined]  # torch's stub lacks it

    def set_once(self, name: str, value: str) -> tuple[bool, str]:
        """Set `name` only if nobody has; return (won, the value that stands, checked). With
        `on_untrusted` set, a standing value this job did not write counts as nobody's: it is
        replaced (compare-and-set against exactly it, so a genuine first value is never lost)."""
        sealed = self._seal(name, value)
        expected: bytes | str = ""
        for _attempt in range(REPAIR_ATTEMPTS):
            current = self._call(self.raw.compare_set, self.key(name), expected, sealed)
            if current == sealed:
                return True, value
            try:
                return False, self._open(name, current).decode()
            except UnicodeDecodeError:
                raise UntrustedValue(f"store key '{self.key(name)}' holds bytes that are not text") from None
            except UntrustedValue as exc:
                if self.on_untrusted is None:
                    raise
                self.on_untrusted(f"{exc}; replaced, the job goes on")
                expected = current
        raise UntrustedValue(f"store key '{self.key(name)}' is rewritten with garbage again and again (a stranger)")

    def get_if_present(self, name: str, *, nobody_waits: bool = False) -> bytes | None:
        """The checked value of `name`, or None when absent.

        `nobody_waits` (a node's assignment): one request, c10d's `compare_set` with an expected
        value no rally writer ever stores (ABSENT: not a sealed value), which changes nothing and
        answers the key's value, or ABSENT itself when there is no key. A stranger who stores
        ABSENT makes the key look absent, which deleting it would do as well.
        Otherwise two requests, a `check` and a `get`: torch's libuv server (the default) wakes a
        key's waiters on every compare_set, set or not, so on a key somebody may wait for
        (`closed`, `end`, the stacks' `dump`) the compare_set would end their waits with the key
        still absent.
        """
        if nobody_waits:
            current = self._call(self.raw.compare_set, self.key(name), ABSENT, ABSENT)
            return None if current == ABSENT else self._open(name, current)
        return self.get(name) if self.check(name) else None

    def wait_and_read(
        self, names: Sequence[str], timeout: float, *, also: Sequence[str] = (), since: Seen | None = None
    ) -> dict[str, Checked] | None:
        """A `wait` for every key, then one `multi_get` of them (`read_each`): two requests. `also`
        and `since` change nothing here (a c10d wait returns no values and has no revisions)."""
        # wait: slice: the caller's timeout
        if not self.try_wait(names, timeout):
            return None
        return self.read_each(names)

    def read_each(self, names: Sequence[str]) -> dict[str, Checked]:
        """The checked values of `names` (all of which exist) in one `multi_get`: the closer's read
        of every node descriptor is one request, not one per node. Each value is checked on its
        own, so a stranger's value is its `UntrustedValue` and hides none of the others."""
        raw = self._bounded_call(self.raw.multi_get, ([self.key(n) for n in names],), self.op_timeout) if names else []
        values: dict[str, Checked] = {}
        for name, sealed in zip(names, raw, strict=True):
            try:
                values[name] = self._open(name, sealed)
            except UntrustedValue as exc:
                values[name] = exc
        return values

    def multi_get(self, names: Sequence[str]) -> list[bytes]:
        raw = self._bounded_call(self.raw.multi_get, ([self.key(n) for n in names],), self.op_timeout)
        return [self._open(n, value) for n, value in zip(names, raw, strict=True)]

    def multi_set(self, items: dict[str, str]) -> None:
        multi_set = self.raw.multi_set  # type: ignore[attr-defined]  # torch's stub lacks it
        self._call(multi_set, [self.key(k) for k in items], [self._seal(k, v) for k, v in items.items()])

    def wait(self, names: Sequence[str], timeout: float) -> None:
        """Block until every key exists (raises StoreTimeout after `timeout` seconds)."""
        self._bounded_call(self.raw.wait, ([self.key(n) for n in names], _seconds(timeout)), timeout)

    def connect_again(self) -> Store:
        """A second connection to the same store, for a thread that blocks in `wait`."""
        try:
            raw = self._reconnect()
        except Exception as exc:  # torch raises several unrelated types here
            raise StoreUnavailable(f"{self.describe} is gone ({_first_line(exc)})") from exc
        return Store(raw, self.prefix, self.describe, self._reconnect, self.signer, self.on_untrusted, self.op_timeout)

    def delete_keys_outside(self, keep_prefix: str) -> int:
        """Delete every key of the whole store that does not start with `keep_prefix`; return
        how many. Used where workers share the rendezvous store (the static backend, whose
        workers connect to --master-port as torchrun's do): between rounds this removes the
        previous attempt's worker keys, so a restarted job never reads a stale address."""
        stale = [k for k in self._call(self.raw.list_keys) if not k.startswith(keep_prefix)]
        for key in stale:
            self._call(self.raw.delete_key, key)
        return len(stale)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def host_tcp_store(port: int, timeout: float, bind: str | None = None, *, loopback_only: bool = False) -> TCPStore:
    """Start a TCPStore server in this process on `port` (0 = a free port from the OS).

    torch's server listens on every interface and has no bind address; with `bind` (an IP
    address, see `listen_address`; `loopback_only`: 127.0.0.1) rally binds the socket itself and
    hands it over (`master_listen_fd`, torch >= 2.1), so the store listens there and nowhere else.
    """
    from torch.distributed import TCPStore

    bind = bind or ("127.0.0.1" if loopback_only else None)
    listen_fd = None
    if bind is not None:
        family = socket.AF_INET6 if ":" in bind else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        # As libuv (torch's own store socket) does: a port whose last job's connections are in
        # TIME_WAIT can be bound again at once (a restarted pod's master, on its fixed port);
        # on Linux this never lets two listeners share a port.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((bind, port))
            sock.listen(512)
        except OSError:
            sock.close()
            raise
        port = sock.getsockname()[1]
        listen_fd = sock.detach()
    try:
        return TCPStore(
            bind or "0.0.0.0",  # the server's own client connects here
            port,
            is_master=True,
            wait_for_workers=False,
            multi_tenant=True,
            timeout=_seconds(timeout),
            master_listen_fd=listen_fd,
        )
    except Exception:
        if listen_fd is not None:
            os.close(listen_fd)
        raise


def listen_address(host: str) -> str | None:
    """Where a store meant to be reached at `host` listens: `localhost` on 127.0.0.1, an IP
    address of this machine (127.0.0.2, ::1, an interface's) on exactly that address; a host
    name or a wildcard on every interface (None), as torch does: a name may resolve to
    127.0.1.1 here while other nodes reach this one by its interface address."""
    if host == "localhost":  # the address a client tries first
        try:
            host = str(socket.getaddrinfo("localhost", None, type=socket.SOCK_STREAM)[0][4][0])
        except (OSError, IndexError):
            return "127.0.0.1"
    try:
        address = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return None
    if address.is_unspecified:
        return None
    if address.is_loopback or str(address) in _interface_addresses():
        return str(address)
    return None


def loopback_address(endpoint: StoreEndpoint) -> str | None:
    """The endpoint's host when it is on loopback (--standalone's localhost, 127.x): such a job
    runs on this machine only, so its nodes' address (and MASTER_ADDR) is that too."""
    if endpoint.etcd or endpoint.file_path or not is_loopback_name(endpoint.host):
        return None
    return endpoint.host


def _interface_addresses() -> set[str]:
    try:
        import psutil

        return {a.address.split("%")[0] for addrs in psutil.net_if_addrs().values() for a in addrs}
    except Exception:  # without the list, an address is bound only when loopback
        return set()


def connect_tcp_store(
    host: str,
    port: int,
    connect_timeout: float,
    op_timeout: float,
    describe: str = "",
    progress: Callable[[str], None] | None = None,
) -> TorchStore:
    """Connect a TCPStore client: wait up to `connect_timeout` for the port to accept (saying so
    through `progress` every few seconds), then give the store `op_timeout` to answer; torch's
    own constructor is not bounded once connected (rendezvous/c10d/connect.py)."""
    describe = describe or f"the store at {host}:{port}"
    try:
        # wait: bounded, said by rendezvous/c10d/connect.py _connect: connect_timeout, with a line every
        #   PROGRESS_SECONDS
        wait_for_store(host, port, describe, connect_timeout, op_timeout, progress)
        from torch.distributed import TCPStore  # after the check: a dead endpoint fails without it

        return bounded(
            lambda: TCPStore(host, port, is_master=False, timeout=_seconds(op_timeout)),
            op_timeout + CONSTRUCTOR_SLACK_SECONDS,
            f"connecting to {describe}",
        )
    except NoStoreThere as exc:
        raise StoreUnavailable(str(exc)) from None


@dataclass(frozen=True)
class StoreEndpoint:
    """Where the rendezvous store lives, which backend speaks to it (rendezvous/backends.py),
    and whether this process should host it. `port` is the one asked for (0: any free port);
    the port a hosted store is bound to is reported by the opened store, never written here."""

    host: str
    port: int
    host_here: bool
    file_path: str | None = None
    etcd: tuple = ()  # etcd client endpoints (etcd/client.py `Member`) for the etcd backends
    backend: str = "c10d"  # the registry entry that opens it (rendezvous/backends.py)
    etcd_access: Any = None  # etcd/http.py `EtcdAccess`: TLS and an etcd user (None: plain HTTP)

    def __str__(self) -> str:
        if self.etcd:
            scheme = "https://" if self.etcd_access is not None and self.etcd_access.tls else ""
            return "etcd at " + ",".join(f"{scheme}{m}" for m in self.etcd)
        return self.file_path or f"{self.host}:{self.port}"


def open_file_store(path: str, prefix: str, op_timeout: float, signer: Signer) -> Store:
    """A FileStore on a shared file system (`--rdzv-conf store_type=file`)."""
    from torch.distributed import FileStore

    def reconnect_file() -> TorchStore:
        store = FileStore(path, -1)
        store.set_timeout(_seconds(op_timeout))
        return store

    describe = f"the rendezvous file store at {path}"
    try:
        return Store(reconnect_file(), prefix, describe, reconnect_file, signer, op_timeout=op_timeout)
    except Exception as exc:
        raise StoreUnavailable(f"cannot open {describe}: {_first_line(exc)}") from exc


def open_tcp_store(
    endpoint: StoreEndpoint,
    prefix: str,
    connect_timeout: float,
    op_timeout: float,
    signer: Signer | None = None,
    progress: Callable[[str], None] | None = None,
) -> tuple[Store, TCPStore | None]:
    """Open a TCPStore; return the client and, when hosted here, the server object (its
    `port` is the bound one; `endpoint` is left as it was).

    The server object must be kept alive for as long as the store should exist. When this
    host should serve but the port is taken, it connects as a client only if the store there
    belongs to this job (another agent of the job hosts it and signed its marker) or is a
    `rally store` service; anything else (another job's store, another program) is an error,
    never a silent join of a stranger's store.
    """
    signer = signer or Signer()
    server = None
    port = endpoint.port
    port_taken = False
    bind: str | None = None
    if endpoint.host_here:
        try:
            bind = listen_address(endpoint.host)
            server = host_tcp_store(port, op_timeout, bind)
            port = server.port
        except Exception:  # port in use: someone on this host already serves
            if port == 0:
                raise
            port_taken = True
    host = (bind or "127.0.0.1") if server is not None else endpoint.host
    describe = f"the rendezvous store at {endpoint.host}:{port}"

    def reconnect() -> TorchStore:
        return connect_tcp_store(host, port, op_timeout, op_timeout, describe)

    wait = min(connect_timeout, HOST_MARKER_WAIT_SECONDS) if port_taken else connect_timeout
    try:
        raw = connect_tcp_store(host, port, wait, op_timeout, describe, None if port_taken else progress)
    except StoreUnavailable as exc:
        if port_taken:
            raise StoreUnavailable(
                _stranger_port_message(endpoint, port, f"it does not serve as a c10d store ({exc})")
            ) from None
        raise
    except Exception as exc:  # torch raises several unrelated types here
        raise StoreUnavailable(
            f"could not reach {describe} within {connect_timeout:g} s ({_first_line(exc)}); "
            "check --rdzv-endpoint and that the store's host is up"
        ) from exc
    store = Store(raw, prefix, describe, reconnect, signer, op_timeout=op_timeout)
    if server is not None:
        store.set(HOST_MARKER_NAME, "hosted by an agent of this job")
    elif port_taken:
        joined = _check_same_job(store, endpoint, port, wait)
        if (say := current_progress()) is not None:
            say(joined)
    return store, server


def _service_marker(store: Store) -> str | None:
    """What the `rally store` marker at the store says: None (none there), "plain" (anyone could
    have written it), "signed" (signed with this job's token: the store is the job's)."""
    if not store._call(store.raw.check, [SERVICE_MARKER_KEY]):
        return None
    if not store.signer.has_token:
        return "plain"
    try:
        value = store._bounded_call(store.raw.get, (SERVICE_MARKER_KEY,), store.op_timeout)
        store.signer.open(SERVICE_MARKER_KEY, value)
    except BadRecord:
        return "plain"
    return "signed"


def _owned_here(owners: list[Listener]) -> bool:
    """The port's listener was opened by this process's user or by root."""
    return bool(owners) and all(owner.uid in (0, os.geteuid()) for owner in owners)


def _check_same_job(store: Store, endpoint: StoreEndpoint, port: int, wait: float) -> str:
    """The port was taken: join a `rally store` service or this job's own host, nothing else, and
    only when its listening socket is this user's or root's (the kernel's socket tables say who
    opened it, rendezvous/c10d/port_owner.py) or the store proves it is the job's with a marker signed
    with the job token. The line that says which store this agent joined."""
    owners = listener_owners(endpoint.host, port)
    ours = _owned_here(owners)
    who = ", ".join(str(owner) for owner in owners) or "a socket this host's tables do not show"
    where = f"{endpoint.host}:{port}"
    service = _service_marker(store)
    if service == "signed":
        return f"joined the `rally store` at {where}, listening at {who}: its marker is signed with this job's token"
    if service == "plain" and ours:
        return f"joined the `rally store` service at {where}, listening at {who} (this user's or root's)"
    if service == "plain":
        raise StoreUnavailable(
            _stranger_port_message(
                endpoint,
                port,
                f"it listens as another user ({who}) and its `rally store` marker is not signed with this job's "
                "token (run `rally store` as this user, or with RALLY_JOB_TOKEN set to the job's token)",
            )
        )
    if not ours and not store.signer.has_token:
        raise StoreUnavailable(
            _stranger_port_message(
                endpoint,
                port,
                f"it listens as another user ({who}); without a job token no store proves it is this job's",
            )
        )
    # wait: short: HOST_MARKER_WAIT_SECONDS (10 s) at most, in MARKER_SLICE_SECONDS slices
    _wait_for_host_marker(store, endpoint, port, wait)
    return f"joined the rendezvous store at {where} hosted by another agent of this job, listening at {who}"


def _wait_for_host_marker(store: Store, endpoint: StoreEndpoint, port: int, wait: float) -> None:
    """The job's hosting agent signs its marker at once; anything else is not this job's store."""
    deadline = time.monotonic() + wait
    while True:
        left = max(0.01, min(MARKER_SLICE_SECONDS, deadline - time.monotonic()))
        # wait: short: a marker the job's host writes at once
        found = store.wait_and_read([HOST_MARKER_NAME], left)
        if found is not None:
            break
        if other := _other_jobs_store(store):
            raise StoreUnavailable(_stranger_port_message(endpoint, port, f"it is the store of another job ({other})"))
        if time.monotonic() >= deadline:
            raise StoreUnavailable(
                _stranger_port_message(endpoint, port, "it is not this job's store (another job, or another program)")
            )
    marker = found[HOST_MARKER_NAME]
    if isinstance(marker, UntrustedValue):
        raise StoreUnavailable(
            _stranger_port_message(endpoint, port, f"its host did not sign with this job's token ({marker})")
        )


def _other_jobs_store(store: Store) -> str | None:
    """The run id of the job whose agent hosts this store, when it is not ours: its host marker
    is there under another job's prefix. Named at once rather than after the marker wait."""
    try:
        keys = store.raw.list_keys()
    except Exception:  # a store that cannot list its keys: the marker wait decides, as before
        return None
    own, suffix = store.key(HOST_MARKER_NAME), "/" + HOST_MARKER_NAME
    others = [k for k in keys if k != own and k.startswith(RALLY_KEY_ROOT) and k.endswith(suffix)]
    return f"run id {others[0][len(RALLY_KEY_ROOT) : -len(suffix)]}" if others else None


def _stranger_port_message(endpoint: StoreEndpoint, port: int, why: str) -> str:
    return (
        f"port {port} on this host ({endpoint.host}) is already taken and {why}; this agent will "
        "not join it. Pick a free port for --rdzv-endpoint (or stop what holds it)"
    )


def is_loopback_name(host: str) -> bool:
    """A store meant for this machine only (--standalone, 127.0.0.1, localhost) binds loopback."""
    return host in ("localhost", "::1") or host.startswith("127.")


def is_local_host(host: str) -> bool:
    """True when `host` names this machine (how torchrun decides who hosts the store)."""
    if host in ("localhost", "127.0.0.1", "::1", "0.0.0.0") or host.startswith("127."):
        return True
    names = {socket.gethostname(), socket.getfqdn()}
    if host in names:
        return True
    try:
        target = {str(info[4][0]) for info in socket.getaddrinfo(host, None)}
    except OSError:
        return False
    mine: set[str] = set()
    for name in names:
        try:
            mine |= {str(info[4][0]) for info in socket.getaddrinfo(name, None)}
        except OSError:
            pass
    try:
        import psutil

        for addrs in psutil.net_if_addrs().values():
            mine |= {a.address.split("%")[0] for a in addrs}
    except Exception:  # psutil missing interfaces is not fatal
        pass
    return bool(target & mine)
