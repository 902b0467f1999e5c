"""c10d key-value stores, wrapped so the rest of rally speaks seconds and clear exceptions.

rally uses torch's own stores (`TCPStore`, `FileStore`) so that a rally job needs nothing
that torch does not already ship. This module hides three awkward corners of them:

* timeouts are `timedelta`s and a timed-out `wait` raises the same `DistStoreError` as other
  faults; here a timeout is `StoreTimeout` and a lost connection is `StoreUnavailable`;
* a client blocked in `wait` blocks every other call on the same connection, so each
  thread that waits gets its own connection (`Store.connect_again`);
* the C++ side logs a warning with a stack trace for every timed-out wait, which is a normal
  event in a rendezvous; the agent silences it with TORCH_CPP_LOG_LEVEL (see `quiet_torch_logs`).
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Callable, ClassVar, Sequence

if TYPE_CHECKING:  # torch is imported lazily: `rally --help` and bad input must not pay 2 s for it.
    from torch.distributed import Store as TorchStore


class StoreError(Exception):
    """Base of store failures that the agent turns into a readable reason."""


class StoreTimeout(StoreError):
    """A wait or get did not see its keys in time; the store itself is fine."""


class StoreUnavailable(StoreError):
    """The store cannot be reached (never was, or its host died)."""


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


@dataclass
class Store:
    """One connection to a c10d store, with every key under `prefix`.

    `describe` is what error messages call the store, e.g. "the rendezvous store at node1:29400".
    """

    raw: "TorchStore"
    prefix: str
    describe: str
    _reconnect: Callable[[], "TorchStore"]
    # Keep-alives are counters watched in a ring here; stores whose keys can expire by
    # themselves (etcd leases, rendezvous/etcd_store.py) set this and offer lease calls instead.
    leased_liveness: ClassVar[bool] = False

    def key(self, name: str) -> str:
        return f"{self.prefix}{name}"

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

    def set(self, name: str, value: str | bytes) -> None:
        self._call(self.raw.set, self.key(name), value)

    def get(self, name: str) -> bytes:
        return self._call(self.raw.get, self.key(name))

    def get_str(self, name: str) -> str:
        return self.get(name).decode()

    def add(self, name: str, amount: int) -> int:
        return int(self._call(self.raw.add, self.key(name), amount))

    def counter(self, name: str) -> int:
        return self.add(name, 0)

    def check(self, name: str) -> bool:
        return bool(self._call(self.raw.check, [self.key(name)]))

    def append(self, name: str, value: str) -> None:
        self._call(self.raw.append, self.key(name), value)

    def compare_set(self, name: str, expected: str, desired: str) -> bytes:
        """Atomically set `name` to `desired` if it holds `expected` ("" = absent); return its value."""
        return self._call(self.raw.compare_set, self.key(name), expected, desired)

    def set_once(self, name: str, value: str) -> tuple[bool, str]:
        """Set `name` only if nobody has; return (won, the value that stands)."""
        current = self.compare_set(name, "", value).decode()
        return current == value, current

    def multi_get(self, names: Sequence[str]) -> list[bytes]:
        return self._call(self.raw.multi_get, [self.key(n) for n in names])

    def multi_set(self, items: dict[str, str]) -> None:
        self._call(self.raw.multi_set, [self.key(k) for k in items], list(items.values()))

    def wait(self, names: Sequence[str], timeout: float) -> None:
        """Block until every key exists (raises StoreTimeout after `timeout` seconds)."""
        self._call(self.raw.wait, [self.key(n) for n in names], _seconds(timeout))

    def try_wait(self, names: Sequence[str], timeout: float) -> bool:
        try:
            self.wait(names, timeout)
            return True
        except StoreTimeout:
            return False

    def connect_again(self) -> "Store":
        """A second connection to the same store, for a thread that blocks in `wait`."""
        try:
            raw = self._reconnect()
        except Exception as exc:  # noqa: BLE001 - torch raises several unrelated types here
            raise StoreUnavailable(f"{self.describe} is gone ({_first_line(exc)})") from exc
        return Store(raw, self.prefix, self.describe, self._reconnect)

    def delete_keys_outside(self, keep_prefix: str) -> int:
        """Delete every key of the whole store that does not start with `keep_prefix`; return
        how many. Used where workers share the rendezvous store (the static backend, whose
        workers connect to --master-port as torchrun's do): between rounds this removes the
        previous attempt's worker keys, so a restarted job never reads a stale address."""
        stale = [k for k in self._call(self.raw.list_keys) if not k.startswith(keep_prefix)]
        for key in stale:
            self._call(self.raw.delete_key, key)
        return len(stale)

    def with_prefix(self, prefix: str) -> "Store":
        return Store(self.raw, self.prefix + prefix, self.describe, self._reconnect)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def host_tcp_store(port: int, timeout: float) -> "TorchStore":
    """Start a TCPStore server in this process on `port` (0 = a free port from the OS)."""
    from torch.distributed import TCPStore

    return TCPStore(
        "0.0.0.0",
        port,
        is_master=True,
        wait_for_workers=False,
        multi_tenant=True,
        timeout=_seconds(timeout),
    )


def connect_tcp_store(host: str, port: int, connect_timeout: float, op_timeout: float) -> "TorchStore":
    """Connect a TCPStore client, retrying until `connect_timeout` (torch retries internally)."""
    from torch.distributed import TCPStore

    client = TCPStore(host, port, is_master=False, timeout=_seconds(connect_timeout))
    client.set_timeout(_seconds(op_timeout))
    return client


@dataclass
class StoreEndpoint:
    """Where the rendezvous store lives and whether this process should host it."""

    host: str
    port: int
    host_here: bool
    file_path: str | None = None
    etcd: tuple = ()  # etcd client endpoints (etcd_client.Member) for the etcd backends

    def __str__(self) -> str:
        if self.etcd:
            return "etcd at " + ",".join(str(m) for m in self.etcd)
        return self.file_path or f"{self.host}:{self.port}"


def open_store(
    endpoint: StoreEndpoint,
    prefix: str,
    connect_timeout: float,
    op_timeout: float,
) -> tuple[Store, "TorchStore | None"]:
    """Open the rendezvous store; return the client and, when hosted here, the server object.

    The server object must be kept alive for as long as the store should exist. When this
    host should serve but the port is taken (several agents on one host), it connects as a
    client instead, as torchrun does. For the etcd backends the client is an `EtcdStore`
    (same interface) and nothing is hosted here.
    """
    if endpoint.etcd:
        from rally.rendezvous.etcd_store import open_etcd_store

        return open_etcd_store(endpoint.etcd, prefix, op_timeout), None  # type: ignore[return-value]
    if endpoint.file_path:
        from torch.distributed import FileStore

        path = endpoint.file_path

        def reconnect_file() -> "TorchStore":
            store = FileStore(path, -1)
            store.set_timeout(_seconds(op_timeout))
            return store

        describe = f"the rendezvous file store at {path}"
        try:
            return Store(reconnect_file(), prefix, describe, reconnect_file), None
        except Exception as exc:  # noqa: BLE001
            raise StoreUnavailable(f"cannot open {describe}: {_first_line(exc)}") from exc

    server = None
    port = endpoint.port
    if endpoint.host_here:
        try:
            server = host_tcp_store(port, op_timeout)
            port = server.port
            endpoint.port = port
        except Exception:  # noqa: BLE001 - port in use: someone on this host already serves
            if port == 0:
                raise
            server = None
    host = "127.0.0.1" if server is not None else endpoint.host
    describe = f"the rendezvous store at {endpoint.host}:{port}"

    def reconnect() -> "TorchStore":
        return connect_tcp_store(host, port, op_timeout, op_timeout)

    try:
        raw = connect_tcp_store(host, port, connect_timeout, op_timeout)
    except Exception as exc:  # noqa: BLE001
        raise StoreUnavailable(
            f"could not reach {describe} within {connect_timeout:g} s ({_first_line(exc)}); "
            "check --rdzv-endpoint and that the store's host is up"
        ) from exc
    return Store(raw, prefix, describe, reconnect), server


def is_local_host(host: str) -> bool:
    """True when `host` names this machine (how torchrun decides who hosts the store)."""
    if host in ("localhost", "127.0.0.1", "::1", "0.0.0.0") or host.startswith("127."):
        return True
    names = {socket.gethostname(), socket.getfqdn()}
    if host in names:
        return True
    try:
        target = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except OSError:
        return False
    mine: set[str] = set()
    for name in names:
        try:
            mine |= {info[4][0] for info in socket.getaddrinfo(name, None)}
        except OSError:
            pass
    try:
        import psutil

        for addrs in psutil.net_if_addrs().values():
            mine |= {a.address.split("%")[0] for a in addrs}
    except Exception:  # noqa: BLE001 - psutil missing interfaces is not fatal
        pass
    return bool(target & mine)
