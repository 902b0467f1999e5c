"""The rendezvous store on an etcd cluster: rally's round protocol without a single point of failure.

`EtcdStore` implements `rally.rendezvous.kv.KeyValueStore` (the interface the round protocol in
`protocol.py` uses) and raises the same `StoreTimeout` / `StoreUnavailable`, so the protocol
runs unchanged on it. Each operation maps onto etcd v3 as follows:

* set / get / check / multi_set / multi_get: put and range (a multi is one transaction);
  `get` and `multi_get` block until their keys exist, as a c10d store's do;
* first-wins keys (`set_once`, `compare_set` with ""): a transaction comparing the key's
  `create_revision` with 0;
* counters (`add`) and `append`: a compare-and-swap transaction on the key's `mod_revision`,
  retried until it wins; the losing branch returns the fresh value, so a retry costs one call;
* `wait`: read the key; when it is missing, watch it from the revision just read (no polling,
  and nothing that happens in between can be missed);
* liveness (`leased_liveness`): a node's keep-alive key is attached to a lease with TTL =
  keep_alive_timeout. The node refreshes the lease; if the node dies, etcd deletes the key by
  itself and the node that watches it (`wait_deleted`) sees the deletion.

Every key lives under the job's prefix `rally/<run_id>/`, as with the c10d store. etcd keeps
them after the job: give each job its own `--rdzv-id` (or delete the prefix with etcdctl).
"""

from __future__ import annotations

import math
import time
from typing import Any, ClassVar, Sequence

from rally.rendezvous.etcd_client import (
    EtcdClient,
    EtcdError,
    EtcdUnavailable,
    Member,
    b64,
    unb64,
)
from rally.rendezvous.kv import KeyValueStore, StoreTimeout, StoreUnavailable, UntrustedValue

# How long rally tries the endpoints at start before giving up with one clear line: etcd is
# infrastructure that must already be running, so an unreachable cluster is reported fast.
CONNECT_SECONDS = 5.0
# etcd refuses transactions with more operations than its --max-txn-ops (default 128).
MAX_TXN_OPS = 128


class EtcdStore(KeyValueStore):
    """One client of an etcd cluster with every key under `prefix` (see the module docstring)."""

    leased_liveness: ClassVar[bool] = True  # keep-alives are leases that expire by themselves

    def __init__(self, client: EtcdClient, prefix: str, op_timeout: float):
        """`op_timeout` bounds one operation, fail-over between members included."""
        self.client = client
        self.prefix = prefix
        self.op_timeout = op_timeout
        self.describe = f"etcd at {client.describe()}"

    def _k(self, name: str) -> str:
        return b64(self.key(name))

    def _call(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        try:
            return self.client.call(path, body, self.op_timeout)
        except EtcdUnavailable as exc:
            raise StoreUnavailable(f"{self.describe} is unreachable: {exc}") from exc
        except EtcdError as exc:
            raise StoreUnavailable(f"{self.describe} refused a request: {exc}") from exc

    def _range(self, name: str) -> tuple[dict | None, int]:
        """(the key's kv or None, the revision the read saw)."""
        reply = self._call("/v3/kv/range", {"key": self._k(name)})
        kvs = reply.get("kvs") or []
        return (kvs[0] if kvs else None), int(reply["header"]["revision"])

    def _txn(self, compare: list[dict], success: list[dict], failure: list[dict]) -> tuple[bool, list[dict]]:
        reply = self._call("/v3/kv/txn", {"compare": compare, "success": success, "failure": failure})
        return bool(reply.get("succeeded")), reply.get("responses") or []

    # ------------------------------------------------------------------ plain keys
    def set(self, name: str, value: str | bytes) -> None:
        self._call("/v3/kv/put", {"key": self._k(name), "value": b64(value)})

    def get(self, name: str) -> bytes:
        """The key's value; blocks up to the operation timeout until it exists (as c10d's get)."""
        while True:
            kv, _ = self._range(name)
            if kv is not None:
                return unb64(kv.get("value"))
            self.wait([name], self.op_timeout)

    def get_unsigned(self, name: str) -> bytes:
        """As `get` (nothing is signed on etcd; see `Store.get_unsigned`)."""
        return self.get(name)

    def get_str(self, name: str) -> str:
        return self.get(name).decode()

    def check(self, name: str) -> bool:
        reply = self._call("/v3/kv/range", {"key": self._k(name), "count_only": True})
        return int(reply.get("count", 0)) > 0

    def multi_get(self, names: Sequence[str]) -> list[bytes]:
        """Every key's value, read in one transaction per MAX_TXN_OPS keys (waits for missing keys)."""
        values: list[bytes] = []
        for start in range(0, len(names), MAX_TXN_OPS):
            chunk = list(names[start : start + MAX_TXN_OPS])
            while True:
                _, responses = self._txn([], [{"request_range": {"key": self._k(n)}} for n in chunk], [])
                kvs = [(r.get("response_range") or {}).get("kvs") or [] for r in responses]
                missing = [n for n, found in zip(chunk, kvs) if not found]
                if not missing:
                    values += [unb64(found[0].get("value")) for found in kvs]
                    break
                self.wait(missing, self.op_timeout)
        return values

    def multi_set(self, items: dict[str, str]) -> None:
        puts = [{"request_put": {"key": self._k(k), "value": b64(v)}} for k, v in items.items()]
        for start in range(0, len(puts), MAX_TXN_OPS):
            self._txn([], puts[start : start + MAX_TXN_OPS], [])

    # ------------------------------------------------------------------ atomic updates
    def _update(self, name: str, change: Any) -> bytes:
        """Apply `change(old value or None) -> new value` atomically (compare-and-swap on
        mod_revision, or on create_revision == 0 when the key is absent); return the new value."""
        kv, _ = self._range(name)
        while True:
            if kv is None:
                compare = {"key": self._k(name), "target": "CREATE", "result": "EQUAL", "create_revision": "0"}
                new = change(None)
            else:
                compare = {"key": self._k(name), "target": "MOD", "result": "EQUAL", "mod_revision": kv["mod_revision"]}
                new = change(unb64(kv.get("value")))
            put = {"request_put": {"key": self._k(name), "value": b64(new)}}
            won, responses = self._txn([compare], [put], [{"request_range": {"key": self._k(name)}}])
            if won:
                return new
            kvs = (responses[0].get("response_range") or {}).get("kvs") if responses else None
            kv = kvs[0] if kvs else None

    def add(self, name: str, amount: int) -> int:
        """Atomically add `amount` to a counter (absent = 0) and return the new value."""
        if amount == 0:
            return self.counter(name)
        return int(self._update(name, lambda old: str(int(old or b"0") + amount).encode()))

    def counter(self, name: str, limit: int | None = None) -> int:
        """A counter's value, checked to be a number in 0..limit (as `Store.counter` checks)."""
        kv, _ = self._range(name)
        raw = unb64(kv.get("value")) or b"0" if kv else b"0"
        try:
            value = int(raw)
        except ValueError:
            raise UntrustedValue(f"store key '{self.key(name)}' holds {raw[:40]!r}, not a counter") from None
        if value < 0 or (limit is not None and value > limit):
            raise UntrustedValue(f"store key '{self.key(name)}' holds {value}, out of range") from None
        return value

    def append(self, name: str, value: str) -> None:
        self._update(name, lambda old: (old or b"") + value.encode())

    def compare_set(self, name: str, expected: str, desired: str) -> bytes:
        """Set `name` to `desired` if it holds `expected` ("" = absent); return the value that stands.

        Like c10d's compare_set, an absent key with a non-empty `expected` returns `expected`.
        """
        if expected == "":
            compare = {"key": self._k(name), "target": "CREATE", "result": "EQUAL", "create_revision": "0"}
        else:
            compare = {"key": self._k(name), "target": "VALUE", "result": "EQUAL", "value": b64(expected)}
        put = {"request_put": {"key": self._k(name), "value": b64(desired)}}
        won, responses = self._txn([compare], [put], [{"request_range": {"key": self._k(name)}}])
        if won:
            return desired.encode()
        kvs = (responses[0].get("response_range") or {}).get("kvs") if responses else None
        return unb64(kvs[0].get("value")) if kvs else expected.encode()

    def set_once(self, name: str, value: str) -> tuple[bool, str]:
        """Set `name` only if nobody has (create_revision == 0); return (won, the value that stands)."""
        compare = {"key": self._k(name), "target": "CREATE", "result": "EQUAL", "create_revision": "0"}
        put = {"request_put": {"key": self._k(name), "value": b64(value)}}
        won, responses = self._txn([compare], [put], [{"request_range": {"key": self._k(name)}}])
        if won:
            return True, value
        kvs = (responses[0].get("response_range") or {}).get("kvs") if responses else None
        return False, unb64(kvs[0].get("value")).decode() if kvs else ""

    # ------------------------------------------------------------------ waiting (watches)
    def wait(self, names: Sequence[str], timeout: float) -> None:
        """Block until every key exists (raises StoreTimeout after `timeout` seconds)."""
        deadline = time.monotonic() + timeout
        for name in names:
            while True:
                kv, revision = self._range(name)
                if kv is not None:
                    break
                if self._watch_until(name, revision + 1, deadline, lambda event: event.get("type", "PUT") == "PUT"):
                    break
                if time.monotonic() >= deadline:
                    raise StoreTimeout(f"timed out after {timeout:g} s waiting for {self.key(name)} in {self.describe}")

    def wait_deleted(self, name: str, timeout: float) -> bool:
        """True once `name` is absent (deleted, or its lease expired); False after `timeout` s."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            kv, revision = self._range(name)
            if kv is None:
                return True
            if self._watch_until(name, revision + 1, deadline, lambda event: event.get("type") == "DELETE", noput=True):
                return True
        return False

    def _watch_until(self, name: str, start_revision: int, deadline: float, wanted: Any, noput: bool = False) -> bool:
        """Watch `name` from `start_revision` until an event satisfies `wanted` (True) or the
        deadline passes (False). A broken stream returns False early: the caller reads again."""
        request: dict[str, Any] = {"key": self._k(name), "start_revision": str(start_revision)}
        if noput:
            request["filters"] = ["NOPUT"]
        try:
            return any(wanted(event) for event in self.client.watch(request, deadline))
        except EtcdUnavailable:
            return False  # the next read fails over to another member (or reports the cluster gone)
        except EtcdError as exc:
            raise StoreUnavailable(f"{self.describe} refused a watch: {exc}") from exc

    # ------------------------------------------------------------------ leases (liveness)
    def grant_lease(self, ttl: float) -> int:
        """A lease that expires `ttl` seconds (rounded up; etcd counts whole seconds, and raises
        very short TTLs to its own minimum) after its last refresh."""
        reply = self._call("/v3/lease/grant", {"TTL": str(max(1, math.ceil(ttl)))})
        return int(reply["ID"])

    def refresh_lease(self, lease: int) -> bool:
        """Renew the lease; False when it has already expired (etcd answers TTL 0)."""
        reply = self._call("/v3/lease/keepalive", {"ID": str(lease)})
        return int((reply.get("result") or reply).get("TTL", 0)) > 0

    def set_leased(self, name: str, value: str, lease: int) -> None:
        """Set `name` so that it is deleted when `lease` expires."""
        self._call("/v3/kv/put", {"key": self._k(name), "value": b64(value), "lease": str(lease)})

    # ------------------------------------------------------------------ connections
    def connect_again(self) -> "EtcdStore":
        """A second client with its own connection, for a thread that blocks in `wait`."""
        return EtcdStore(self.client.fork(), self.prefix, self.op_timeout)

def open_etcd_store(members: Sequence[Member], prefix: str, op_timeout: float, connect_timeout: float = CONNECT_SECONDS) -> EtcdStore:
    """Connect to the cluster (any member will do) and check that it serves reads.

    Raises StoreUnavailable with one line naming every endpoint when none answers within
    `connect_timeout` seconds.
    """
    client = EtcdClient(list(members))
    store = EtcdStore(client, prefix, op_timeout)
    try:
        client.call("/v3/kv/range", {"key": b64(prefix), "count_only": True}, connect_timeout)
    except (EtcdUnavailable, EtcdError) as exc:
        raise StoreUnavailable(
            f"cannot reach etcd at {client.describe()}: {exc}; check "
            "--rdzv-endpoint (etcd client endpoints HOST[:PORT],..., default port 2379) and that etcd is running"
        ) from exc
    return store
