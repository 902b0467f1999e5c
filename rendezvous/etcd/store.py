"""The rendezvous store on an etcd cluster: rally's round protocol without a single point of failure.

`EtcdStore` implements `rally.rendezvous.base.kv.KeyValueStore` (the interface the round protocol in
`protocol.py` uses) and raises the same `StoreTimeout` / `StoreUnavailable`, so the protocol
runs unchanged on it. Each operation maps onto etcd v3 as follows:

* set / get / check / multi_set / multi_get: put and range (a multi is one transaction);
  `get` and `multi_get` block until their keys exist, as a c10d store's do;
* first-wins keys (`set_once`, `compare_set` with ""): a transaction comparing the key's
  `create_revision` with 0;
* counters: an increment by one (`add(name, 1)`, and `arrive`, a node's place in a round's
  arrival order) is a key of its own, `<name>\\x00<id>`, created in a transaction that also
  reads the base value and counts the increments: one request per node, never a retry on a
  shared key, however many nodes arrive at once (a compare-and-swap on one counter costs
  O(N) retries per node under contention, O(N^2) requests in all). Other amounts are a
  compare-and-swap on the base value; a read is one range over the base key and its increments;
* `append`: one key per piece, `<name>\\x01<id>`, read back in create-revision order;
* every value rally writes is signed with the job token as on c10d (`rendezvous/base/token.py`):
  a stranger's value is rejected with one line naming the key. Counters and appended lists
  are unsigned, as on c10d; etcd's own authentication keeps strangers out altogether;
* reads return what they read: `get_if_present` is one range (whoever waits for the key),
  `read_present` one transaction of a range per key, `get_present` one range over the span of
  many keys (the closer's node descriptors), `counter_and_present` a counter and keys in one
  transaction;
* `wait` / `wait_and_read`: read which keys are missing (many keys: one range over the span they
  cover, or transactions of up to 128 reads); watch the missing ones from the revision just read
  (no polling, and nothing that happens in between can be missed). `wait_and_read` returns the
  values the read and the watch's events carried, so no read follows it; keys passed as `also`
  are watched on the same stream and returned when they come (a node's assignment, written just
  before the round's record it waits for). Given `since`, a read just made (`read_now`, or the
  round's record read by `arrive_holding`), the wait takes what that read found and watches from
  its revision, without a read of its own. So a node joins in three requests: its first look
  (`counter_and_present`), its arrival (`arrive_holding`), one watch that returns the round's
  record and its assignment; in a fresh job's first round in two, the first look being the
  arrival too (`arrive_if_fresh`). Nothing is cached between calls: a value flows back as a
  return value;
* liveness (`leased_liveness`): a node's keep-alive key is attached to a lease with TTL =
  keep_alive_timeout. The node refreshes the lease; if the node dies, etcd deletes the key by
  itself and the node that watches it (`wait_deleted`) sees the deletion.

Every key lives under the job's prefix `rally/<run_id>/`, as with the c10d store. etcd keeps
them after the job: give each job its own `--rdzv-id` (or delete the prefix with etcdctl).

What the gateway answers is read as etcd writes it (`reply["header"]["revision"]`, a kv's
`value`); a reply of another shape (a hostile or broken gateway: a list where an object goes, a
number where base64 goes) is `StoreUnavailable` with one line from every public method
(`_shape_checked`), never the AttributeError, TypeError or KeyError the read would raise.
"""

from __future__ import annotations

import binascii
import functools
import math
import time
import uuid
from collections.abc import Callable, Generator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from rally.rendezvous.base.kv import Checked, KeyValueStore, Seen, StoreTimeout, StoreUnavailable, UntrustedValue
from rally.rendezvous.base.token import BadRecord, Signer
from rally.rendezvous.etcd.client import (
    EtcdClient,
    EtcdError,
    EtcdUnavailable,
    b64,
    unb64,
)
from rally.rendezvous.status.long_wait import LongWait

# etcd refuses transactions with more operations than its --max-txn-ops (default 128).
MAX_TXN_OPS = 128
# How many of a `multi_set`'s transactions are sent at once (each on a connection of its own).
PARALLEL_TXNS = 8
# Many keys are read as one range over their span (`_read`), unless it holds more than SPAN_SLACK x
# as many other keys.
SPAN_MIN_KEYS, SPAN_SLACK = 4, 2
# Where a counter's increments by one and a list's appended pieces live, one key per call (see
# `EtcdStore.add` and `append`): `<name>\x00<id>` and `<name>\x01<id>`. Keys sort bytewise, so the
# keys from `<name>` up to `<name>\x01` are exactly the base key and its increments.
INCREMENTS = "\x00"
APPENDED = "\x01"
APPENDED_END = "\x02"


def _signed_as(own: str) -> str:
    """The name an arrival's value (`EtcdStore.arrive_holding`) is signed for: its key with the
    increment mark as `#` (a signed record names its key before a NUL, rendezvous/base/token.py)."""
    return own.replace(INCREMENTS, "#")


S = TypeVar("S")
# What reading a reply of the wrong shape raises (binascii.Error: base64 that is not).
SHAPE_ERRORS = (AttributeError, TypeError, KeyError, IndexError, ValueError, RecursionError, binascii.Error)


def _shape_checked(cls: type[S]) -> type[S]:
    """Every public method of `cls` turns an error of a reply's shape into one StoreUnavailable line
    (UnicodeDecodeError, which the methods themselves turn into UntrustedValue, is left alone)."""

    def checked(method: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(method)
        def call(self: EtcdStore, *args: Any, **kwargs: Any) -> Any:
            try:
                return method(self, *args, **kwargs)
            except UnicodeDecodeError:
                raise
            except SHAPE_ERRORS as exc:
                raise StoreUnavailable(
                    f"{self.describe} sent a reply of a shape etcd never sends (reading it raised "
                    f"{type(exc).__name__}, {str(exc)[:120]}): what answers there is not an etcd gateway, "
                    "or a hostile one"
                ) from None

        return call

    for name, member in list(vars(cls).items()):
        if not name.startswith("_") and callable(member):
            setattr(cls, name, checked(member))
    return cls


@_shape_checked
class EtcdStore(KeyValueStore):
    """One client of an etcd cluster with every key under `prefix` (see the module docstring)."""

    def __init__(
        self,
        client: EtcdClient,
        prefix: str,
        op_timeout: float,
        signer: Signer | None = None,
        progress: Callable[[str], None] | None = None,
    ):
        """`op_timeout` bounds one operation, fail-over between members included; `signer`
        signs every value with the job token, as on c10d (rendezvous/base/token.py); `progress` hears
        every few seconds what a `get` of a key not yet written waits for."""
        self.client = client
        self.progress = progress
        self.prefix = prefix
        self.op_timeout = op_timeout
        self.signer = signer or Signer()
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
        won, responses, _ = self._txn_at(compare, success, failure)
        return won, responses

    def _txn_at(self, compare: list[dict], success: list[dict], failure: list[dict]) -> tuple[bool, list[dict], int]:
        """A transaction: (whether the compares held, the responses, the revision it ran at)."""
        reply = self._call("/v3/kv/txn", {"compare": compare, "success": success, "failure": failure})
        return bool(reply.get("succeeded")), reply.get("responses") or [], int(reply["header"]["revision"])

    # ------------------------------------------------------------------ signed values
    def _seal(self, name: str, value: str | bytes) -> str:
        """The value as stored: signed with the job token (rendezvous/base/token.py), base64 for the gateway."""
        return self._seal_raw(self.key(name), value)

    def _seal_raw(self, key: str, value: str | bytes) -> str:
        """`_seal` for a key named in full (prefix included)."""
        return b64(self.signer.seal(key, value))

    def _open(self, name: str, kv: dict) -> bytes:
        """A stored value's payload, or UntrustedValue naming the key (a stranger wrote it)."""
        return self._open_raw(self.key(name), kv)

    def _open_raw(self, key: str, kv: dict) -> bytes:
        """`_open` for a key named in full (prefix included)."""
        try:
            return self.signer.open(key, unb64(kv.get("value")))
        except BadRecord as exc:
            raise UntrustedValue(str(exc)) from None

    # ------------------------------------------------------------------ plain keys
    def set(self, name: str, value: str | bytes) -> None:
        """Write a signed value; `get` checks the signature."""
        self._call("/v3/kv/put", {"key": self._k(name), "value": self._seal(name, value)})

    def get(self, name: str) -> bytes:
        """The key's value; blocks up to the operation timeout until it exists (as c10d's get),
        in slices that say what they wait for (rally reads a key it has seen: a `get` waits only
        for a key deleted in between). One range when the key exists."""
        wait: LongWait | None = None
        while True:
            kv, revision = self._range(name)
            if kv is not None:
                return self._open(name, kv)
            wait = wait or self._key_slices([name])
            # wait: slice, said by EtcdStore.get: slices of op_timeout (read_timeout) for a key not yet written
            found = self._wait_kvs([name], wait.slice(), absent_at=revision)
            if found is not None:
                return self._open(name, found[name])
            if not wait.tick():
                raise StoreTimeout(
                    f"timed out after {self.op_timeout:g} s waiting for {self.key(name)} in {self.describe}"
                )

    def get_str(self, name: str) -> str:
        try:
            return self.get(name).decode()
        except UnicodeDecodeError:
            raise UntrustedValue(f"store key '{self.key(name)}' holds bytes that are not text") from None

    def check(self, name: str) -> bool:
        """Whether the key exists: one range."""
        return self._range(name)[0] is not None

    def get_if_present(self, name: str, *, nobody_waits: bool = False) -> bytes | None:
        """The checked value of `name`, or None when absent: one range, whoever waits for the key."""
        kv, _ = self._range(name)
        return None if kv is None else self._open(name, kv)

    def multi_get(self, names: Sequence[str]) -> list[bytes]:
        """Every key's value, read at once (`_read`); waits for missing keys in slices that say what
        they wait for, and takes their values from the wait (no read after it)."""
        found, read_at = self._read(names)
        revision: int | None = read_at
        missing = [n for n in names if n not in found]
        wait = self._key_slices(missing) if missing else None
        while wait:
            # wait: slice, said by EtcdStore.multi_get: slices of op_timeout (read_timeout)
            seen = self._wait_kvs(missing, wait.slice(), absent_at=revision)
            revision = None
            if seen is not None:
                found.update(seen)
                break
            if not wait.tick():
                missed = self.key(missing[0])
                raise StoreTimeout(f"timed out after {self.op_timeout:g} s waiting for {missed} in {self.describe}")
        return [self._open(n, found[n]) for n in names]

    def get_present(self, names: Sequence[str]) -> dict[str, Checked]:
        """The keys of `names` that exist, read at once: one range over their span (or
        transactions of MAX_TXN_OPS reads)."""
        found, _ = self._read(names)
        return self._open_found(names, found)

    def read_each(self, names: Sequence[str]) -> dict[str, Checked]:
        """Keys known to exist, read at once: `get_present` (one range)."""
        return self.get_present(names)

    def _open_found(self, names: Sequence[str], found: dict[str, dict]) -> dict[str, Checked]:
        """The checked values of those of `names` that were read (a value this job did not write is
        its `UntrustedValue`, so one stranger's key hides none of the others)."""
        present: dict[str, Checked] = {}
        for name in names:
            if name in found:
                try:
                    present[name] = self._open(name, found[name])
                except UntrustedValue as exc:
                    present[name] = exc
        return present

    def _key_slices(self, names: Sequence[str]) -> LongWait:
        """The bounded wait of a `get` for keys not yet written (rendezvous/status/long_wait.py)."""
        more = f" and {len(names) - 1} more" if len(names) > 1 else ""
        return LongWait(
            f"waiting for store key {self.key(names[0])}{more} in {self.describe}",
            self.op_timeout,
            self.progress or (lambda _line: None),
        )

    def multi_set(self, items: dict[str, str]) -> None:
        """Write every key: transactions of MAX_TXN_OPS puts, sent at once on connections of their
        own when there are several (the closer's 1,024 assignments: etcd commits 8 transactions
        sent together about as fast as one, and in a row they were a third of the close)."""
        puts = [{"request_put": {"key": self._k(k), "value": self._seal(k, v)}} for k, v in items.items()]
        chunks = [puts[start : start + MAX_TXN_OPS] for start in range(0, len(puts), MAX_TXN_OPS)]
        if len(chunks) <= 1:
            for chunk in chunks:
                self._txn([], chunk, [])
            return
        with ThreadPoolExecutor(min(len(chunks), PARALLEL_TXNS)) as pool:
            for _ in pool.map(lambda chunk: self.connect_again()._txn([], chunk, []), chunks):
                pass

    # ------------------------------------------------------------------ counters: a base value plus keys of their own
    def _own_key(self, name: str, mark: str) -> str:
        """A fresh key `<name><mark><id>` for one increment or one appended piece; the id starts with
        the wall clock, so the keys sort about as they were made (`arrivals(..., by_key=True)`)."""
        return f"{self.key(name)}{mark}{time.time_ns():016x}{uuid.uuid4().hex}"

    def _marked(self, name: str, first: str, end: str, **options: object) -> dict:
        """A range request over the keys from `<name><first>` up to `<name><end>` (exclusive)."""
        return {
            "request_range": {"key": b64(self.key(name) + first), "range_end": b64(self.key(name) + end), **options}
        }

    def _counter_range(self, name: str) -> dict:
        """One range that reads a counter: the keys from `<name>` to `<name>\\x01` are the base
        key (sorted first) and the increments `<name>\\x00<id>`, nothing else; `limit 1` returns
        the base's value (when it exists) and `count` all of them."""
        return self._marked(name, "", APPENDED, limit="1")

    def _counted(self, name: str, reply: dict, counted: int | None = None) -> int:
        """The value of a counter read by `_counter_range`: base value plus increments (or plus
        `counted` keys, base included, when the caller counted them itself)."""
        kvs = reply.get("kvs") or []
        base = kvs[0] if kvs and unb64(kvs[0].get("key")) == self.key(name).encode() else None
        total = int(reply.get("count", 0)) if counted is None else counted
        return self._base(name, base) + total - (1 if base else 0)

    def _base(self, name: str, kv: dict | None) -> int:
        """A counter's base value (absent = 0); text that is not a number is a stranger's."""
        raw = (unb64(kv.get("value")) or b"0") if kv else b"0"
        try:
            return int(raw)
        except ValueError:
            raise UntrustedValue(f"store key '{self.key(name)}' holds {raw[:40]!r}, not a counter") from None

    def add(self, name: str, amount: int) -> int:
        """Atomically add `amount` to a counter (absent = 0) and return the new value.

        An increment by one, what every node does at once (arrivals, successes, acknowledgements),
        creates a key of its own (`<name>\\x00<id>`) and reads the count in the same transaction:
        one request, never a retry, however many nodes add at the same moment. Other amounts
        (rare) are a compare-and-swap on the base value.
        """
        if amount == 0:
            return self.counter(name)
        if amount != 1:
            return self._add_to_base(name, amount)
        own = self._own_key(name, INCREMENTS)
        absent = {"key": b64(own), "target": "CREATE", "result": "EQUAL", "create_revision": "0"}
        won, responses = self._txn(
            [absent],
            [{"request_put": {"key": b64(own), "value": b64("1")}}, self._counter_range(name)],
            [{"request_range": {"key": b64(own)}}],
        )
        if won:
            return self._counted(name, responses[1].get("response_range") or {})
        # This request was applied once already (its reply was lost, and the client sent it
        # again): count what existed when our key was created.
        # etcd's `count` ignores a create-revision filter, so the kept keys are counted here.
        created = int(responses[0]["response_range"]["kvs"][0]["create_revision"])
        earlier = self._marked(name, "", APPENDED, max_create_revision=str(created))["request_range"]
        reply = self._call("/v3/kv/range", earlier)
        return self._counted(name, reply, counted=len(reply.get("kvs") or []))

    # ------------------------------------------------------------------ arrivals in etcd's own order
    def arrive_holding(self, counter: str, value: str, also: str) -> tuple[int, int, Seen]:
        """Count this caller in to `counter` with an increment key that holds `value`, signed
        (`<counter>\\x00<id>`), and read the key `also`: one transaction. Return (this caller's
        0-based place: how many increments existed before it, its key's create revision, what
        the read of `also` saw).

        etcd orders the arrivals (create revisions), so nobody can move a place, and the slot is
        the increment itself: no second request to claim one. What `also` held (the round's
        record), or the revision it was absent at, serves as the read that precedes the wait for
        it (`wait_and_read(..., since=...)` watches from there without a read of its own).
        """
        own = self._own_key(counter, INCREMENTS)
        put, count, also_read = self._arrival_ops(own, counter, value, also)
        won, responses, revision = self._txn_at(
            [self._absent_own(own)], [put, count, also_read], [{"request_range": {"key": b64(own)}}, also_read]
        )
        seen = self._seen(also, responses[-1], revision)
        if won:
            return int((responses[1].get("response_range") or {}).get("count", 0)) - 1, revision, seen
        return (*self._resent_arrival(counter, responses[0]), seen)

    def arrive_if_fresh(
        self, counter: str, value: str, also: str, hint: str, limit: int, ends: Sequence[str]
    ) -> tuple[tuple[int, int, Seen] | None, int, dict[str, Checked]]:
        """`arrive_holding` if the job is fresh (the counter `hint` and every key of `ends` absent:
        a new job's first round), else `counter_and_present(hint, limit, ends)` instead: one
        transaction either way. Return (the arrival or None, the hint's value, the checked values
        of those of `ends` that exist).
        A new job's nodes join in two requests this way (this and the watch), not three."""
        own = self._own_key(counter, INCREMENTS)
        put, count, also_read = self._arrival_ops(own, counter, value, also)
        hint_range = self._counter_range(hint)
        fresh = [
            {**hint_range["request_range"], "target": "CREATE", "result": "EQUAL", "create_revision": "0"},
            *({"key": self._k(n), "target": "CREATE", "result": "EQUAL", "create_revision": "0"} for n in ends),
        ]
        fresh[0].pop("limit")
        look = [hint_range, *({"request_range": {"key": self._k(n)}} for n in ends)]
        own_read = {"request_range": {"key": b64(own)}}
        won, responses, revision = self._txn_at(
            [self._absent_own(own), *fresh], [put, count, also_read], [*look, own_read, also_read]
        )
        seen = self._seen(also, responses[-1], revision)
        if won:
            return (int((responses[1].get("response_range") or {}).get("count", 0)) - 1, revision, seen), 0, {}
        if (responses[-2].get("response_range") or {}).get("kvs"):  # sent again after a lost reply: arrived
            return (*self._resent_arrival(counter, responses[-2]), seen), 0, {}
        ranges = [r.get("response_range") or {} for r in responses]
        found = {n: r["kvs"][0] for n, r in zip(ends, ranges[1 : 1 + len(ends)], strict=True) if r.get("kvs")}
        return None, self._in_range(hint, self._counted(hint, ranges[0]), limit), self._open_found(ends, found)

    def _arrival_ops(self, own: str, counter: str, value: str, also: str) -> tuple[dict, dict, dict]:
        """An arrival's operations: the put of its increment key `own` (its value signed), the count
        of the increments (without their values: `arrivals` reads the same range), a read of `also`."""
        put = {"request_put": {"key": b64(own), "value": self._seal_raw(_signed_as(own), value)}}
        count = self._marked(counter, INCREMENTS, APPENDED, count_only=True)
        return put, count, {"request_range": {"key": self._k(also)}}

    @staticmethod
    def _absent_own(own: str) -> dict:
        return {"key": b64(own), "target": "CREATE", "result": "EQUAL", "create_revision": "0"}

    def _seen(self, name: str, response: dict, revision: int) -> Seen:
        """What a read of `name` in a transaction saw, at the transaction's revision."""
        kvs = (response.get("response_range") or {}).get("kvs") or []
        return Seen(self._open_found([name], {name: kvs[0]} if kvs else {}), revision)

    def _resent_arrival(self, counter: str, own_read: dict) -> tuple[int, int]:
        """An arrival sent again after a lost reply: its key exists; (its place: the increments
        created up to it, less one; its create revision)."""
        created = int(own_read["response_range"]["kvs"][0]["create_revision"])
        earlier = self._marked(counter, INCREMENTS, APPENDED, max_create_revision=str(created), keys_only=True)
        reply = self._call("/v3/kv/range", earlier["request_range"])
        return len(reply.get("kvs") or []) - 1, created

    def arrivals(self, counter: str, limit: int, by_key: bool = False) -> tuple[int, list[tuple[int, Checked]]]:
        """How many increments `counter` has, and the first `limit` of them (all for 0) in the order
        they were made (create revision, payload checked; a value this job did not sign is its
        UntrustedValue): one range, whatever the count. `by_key`: in key order (about the order
        they were made, by the makers' clocks): etcd sorts by create revision only after reading
        every value in the range, so a few of thousands (a progress line's hosts) are read this way."""
        order = {} if by_key else {"sort_order": "ASCEND", "sort_target": "CREATE"}
        ordered = self._marked(counter, INCREMENTS, APPENDED, limit=str(limit), **order)
        reply = self._call("/v3/kv/range", ordered["request_range"])
        found: list[tuple[int, Checked]] = []
        for kv in reply.get("kvs") or []:
            key = unb64(kv.get("key")).decode(errors="replace")
            try:
                found.append((int(kv["create_revision"]), self._open_raw(_signed_as(key), kv)))
            except UntrustedValue as exc:
                found.append((int(kv["create_revision"]), exc))
        return int(reply.get("count", 0)), found

    def wait_arrival(self, counter: str, after: int, timeout: float) -> bool:
        """True once an increment of `counter` newer than revision `after` exists; False after `timeout`."""
        request = {
            "key": b64(self.key(counter) + INCREMENTS),
            "range_end": b64(self.key(counter) + APPENDED),
            "start_revision": str(after + 1),
            "filters": ["NODELETE"],
        }
        return any(True for _ in self._watch(request, time.monotonic() + timeout))

    def _add_to_base(self, name: str, amount: int) -> int:
        """Add to the counter's base value (compare-and-swap on mod_revision); return the total."""
        kv, _ = self._range(name)
        while True:
            if kv is None:
                compare = {"key": self._k(name), "target": "CREATE", "result": "EQUAL", "create_revision": "0"}
                old = 0
            else:
                compare = {"key": self._k(name), "target": "MOD", "result": "EQUAL", "mod_revision": kv["mod_revision"]}
                old = self._base(name, kv)
            put = {"request_put": {"key": self._k(name), "value": b64(str(old + amount))}}
            won, responses = self._txn(
                [compare], [put, self._counter_range(name)], [{"request_range": {"key": self._k(name)}}]
            )
            if won:
                return self._counted(name, responses[1].get("response_range") or {})
            kvs = (responses[0].get("response_range") or {}).get("kvs") if responses else None
            kv = kvs[0] if kvs else None

    def counter(self, name: str, limit: int | None = None) -> int:
        """A counter's value, checked to be a number in 0..limit (as `Store.counter` checks)."""
        return self._in_range(
            name, self._counted(name, self._call("/v3/kv/range", self._counter_range(name)["request_range"])), limit
        )

    def _in_range(self, name: str, value: int, limit: int | None) -> int:
        if value < 0 or (limit is not None and value > limit):
            bound = "" if limit is None else f" (at most {limit})"
            raise UntrustedValue(
                f"store key '{self.key(name)}' holds {value}, out of range{bound}: a stranger wrote to the store"
            )
        return value

    def append(self, name: str, value: str) -> None:
        """Append to a list key in one request, never a retry: the piece is a key of its own under
        `<name>\\x01<id>` (the list key itself is created empty by the first appender, so `check` sees it)."""
        own = self._own_key(name, APPENDED)
        piece = {"request_put": {"key": b64(own), "value": b64(value)}}
        absent = {"key": self._k(name), "target": "CREATE", "result": "EQUAL", "create_revision": "0"}
        self._txn([absent], [{"request_put": {"key": self._k(name), "value": ""}}, piece], [piece])

    def get_unsigned(self, name: str) -> bytes | None:
        """A list key written by `append` (unsigned, as on c10d): the pieces in the order written,
        None when nobody appended. One transaction."""
        ordered = self._marked(name, APPENDED, APPENDED_END, sort_order="ASCEND", sort_target="CREATE")
        _, responses = self._txn([], [{"request_range": {"key": self._k(name)}}, ordered], [])
        parts = [(r.get("response_range") or {}).get("kvs") or [] for r in responses]
        if not parts or not parts[0]:
            return None
        return b"".join(unb64(kv.get("value")) for kvs in parts for kv in kvs)

    def compare_set(self, name: str, expected: str, desired: str) -> bytes:
        """Set `name` to `desired` if it holds `expected` ("" = absent); return the value that stands.

        Like c10d's compare_set, an absent key with a non-empty `expected` returns `expected`.
        """
        if expected == "":
            compare = {"key": self._k(name), "target": "CREATE", "result": "EQUAL", "create_revision": "0"}
        else:
            compare = {"key": self._k(name), "target": "VALUE", "result": "EQUAL", "value": self._seal(name, expected)}
        put = {"request_put": {"key": self._k(name), "value": self._seal(name, desired)}}
        won, responses = self._txn([compare], [put], [{"request_range": {"key": self._k(name)}}])
        if won:
            return desired.encode()
        kvs = (responses[0].get("response_range") or {}).get("kvs") if responses else None
        return self._open(name, kvs[0]) if kvs else expected.encode()

    def set_once(self, name: str, value: str) -> tuple[bool, str]:
        """Set `name` only if nobody has (create_revision == 0); return (won, the value that stands, checked)."""
        compare = {"key": self._k(name), "target": "CREATE", "result": "EQUAL", "create_revision": "0"}
        sealed = self._seal(name, value)
        put = {"request_put": {"key": self._k(name), "value": sealed}}
        won, responses = self._txn([compare], [put], [{"request_range": {"key": self._k(name)}}])
        if won:
            return True, value
        kvs = (responses[0].get("response_range") or {}).get("kvs") if responses else None
        if not kvs:
            return False, ""
        if kvs[0].get("value") == sealed:
            # This very value stands: our own write, applied, whose reply was lost and which the client
            # sent again (etcd/client.py). It won, as on c10d (`Store.set_once`); else a node whose slot
            # claim timed out under load claimed a second slot and left another node out of the round.
            return True, value
        try:
            return False, self._open(name, kvs[0]).decode()
        except UnicodeDecodeError:
            raise UntrustedValue(f"store key '{self.key(name)}' holds bytes that are not text") from None

    # ------------------------------------------------------------------ waiting (watches)
    def _read(self, names: Sequence[str]) -> tuple[dict[str, dict], int]:
        """The kvs of those of `names` that exist, and the oldest revision of the reads: one range
        over the span from the first key to the last when that span holds few other keys (one
        request for the closer's 1024 node descriptors), else a transaction per MAX_TXN_OPS."""
        if len(names) >= SPAN_MIN_KEYS:
            by_key = {self.key(n).encode(): n for n in names}
            limit = SPAN_SLACK * len(by_key) + SPAN_MIN_KEYS
            span = {"key": b64(min(by_key)), "range_end": b64(max(by_key) + b"\0"), "limit": str(limit)}
            reply = self._call("/v3/kv/range", span)
            if not reply.get("more"):
                named = ((by_key.get(unb64(kv.get("key"))), kv) for kv in reply.get("kvs") or [])
                return {n: kv for n, kv in named if n is not None}, int(reply["header"]["revision"])
        return self._read_keys(names)

    def _read_keys(self, names: Sequence[str]) -> tuple[dict[str, dict], int]:
        """`_read` key by key: a transaction of a range per key, per MAX_TXN_OPS keys."""
        found: dict[str, dict] = {}
        revision: int | None = None
        for start in range(0, len(names), MAX_TXN_OPS):
            chunk = list(names[start : start + MAX_TXN_OPS])
            reply = self._call(
                "/v3/kv/txn",
                {"compare": [], "success": [{"request_range": {"key": self._k(n)}} for n in chunk], "failure": []},
            )
            kvs = [(r.get("response_range") or {}).get("kvs") for r in reply.get("responses") or []]
            found.update((n, kv[0]) for n, kv in zip(chunk, kvs, strict=True) if kv)
            revision = revision or int(reply["header"]["revision"])
        return found, revision or 0

    def all_present(self, names: Sequence[str]) -> bool:
        """Every key of `names` exists: the one transaction of `read_present`."""
        return len(self.read_present(names)) == len(set(names))

    def read_present(self, names: Sequence[str]) -> dict[str, Checked]:
        """The keys of `names` that exist, in one transaction of a range each (a few unrelated keys:
        the end records a node checks before it joins); each value checked on its own."""
        return self.read_now(names).values

    def read_now(self, names: Sequence[str]) -> Seen:
        """`read_present` and the revision it read at: a wait right after for the keys it found
        absent watches from there (`wait_and_read`'s `since`), without a read of its own."""
        found, revision = self._read_keys(names)
        return Seen(self._open_found(names, found), revision)

    def counter_and_present(self, counter: str, limit: int, names: Sequence[str]) -> tuple[int, dict[str, Checked]]:
        """`counter(counter, limit)` and `read_present(names)` in one transaction (a joining node's first look)."""
        reads = [self._counter_range(counter), *({"request_range": {"key": self._k(n)}} for n in names)]
        _, responses = self._txn([], reads, [])
        ranges = [r.get("response_range") or {} for r in responses]
        found = {n: r["kvs"][0] for n, r in zip(names, ranges[1:], strict=True) if r.get("kvs")}
        return self._in_range(counter, self._counted(counter, ranges[0]), limit), self._open_found(names, found)

    def wait(self, names: Sequence[str], timeout: float) -> None:
        """Block until every key exists (raises StoreTimeout after `timeout` seconds): `_wait_kvs`."""
        # wait: slice: the caller's timeout
        if self._wait_kvs(names, timeout) is None:
            raise StoreTimeout(f"timed out after {timeout:g} s waiting for {self.key(names[0])} in {self.describe}")

    def wait_and_read(
        self, names: Sequence[str], timeout: float, *, also: Sequence[str] = (), since: Seen | None = None
    ) -> dict[str, Checked] | None:
        """The checked values of `names` once all exist (None after `timeout` s), as the wait read
        them (`_wait_kvs`: a range or the watch's events, no read after it), with those of `also`
        that the same watch saw. `since`: a read just made (`read_now`, `arrive_holding`); what it
        found is taken as it is and the wait for the rest watches from its revision, without a read."""
        values = {n: v for n, v in (since.values if since else {}).items() if n in names}
        pending = [n for n in names if n not in values]
        absent_at = since.at if since is not None else None
        # wait: slice: the caller's timeout
        found = self._wait_kvs(pending, timeout, also, absent_at) if pending else {}
        if found is None:
            return None
        return {**values, **self._open_found([*pending, *also], found)}

    def _wait_kvs(
        self, names: Sequence[str], timeout: float, also: Sequence[str] = (), absent_at: int | None = None
    ) -> dict[str, dict] | None:
        """The kvs of every key of `names` once all exist (and of those of `also` the watch saw
        on the way), None after `timeout` seconds.

        Reads which keys are missing (`_read`: the closer's wait for N node descriptors is one
        request), or takes `absent_at`, a revision a read just found them all absent at; then
        opens one watch, from that revision, over the key range that spans the missing keys (and
        a watch of each key of `also` on the same stream): each put of a missing key arrives as an
        event carrying the key as written, so the keys that come later cost no further read. A
        broken watch means: read again, watch again. An `also` key written before that revision,
        or after the awaited keys, is not in the answer: the caller reads it then.
        """
        deadline = time.monotonic() + timeout
        pending = list(names)
        found: dict[str, dict] = {}
        watched_also = {self.key(n).encode(): n for n in also if n not in names}
        while True:
            if absent_at is not None:  # a read just found them absent: watch from there
                revision, absent_at = absent_at, None
            elif len(pending) == 1:
                kv, revision = self._range(pending[0])
                if kv is not None:
                    found[pending[0]] = kv
                    pending = []
            else:
                read, revision = self._read(pending)
                found.update(read)
                pending = [n for n in pending if n not in found]
            if not pending:
                return found
            by_key = {self.key(n).encode(): n for n in pending}
            first, last = min(by_key), max(by_key)
            request: dict[str, Any] = {"key": b64(first), "start_revision": str(revision + 1)}
            if len(by_key) > 1:
                request["range_end"] = b64(last + b"\0")
            side = tuple({"key": b64(key), "start_revision": str(revision + 1)} for key in watched_also)
            for event in self._watch(request, deadline, side):
                kv = event.get("kv") or {}
                key = unb64(kv.get("key"))
                if event.get("type", "PUT") != "PUT":
                    continue
                if key in watched_also:
                    found[watched_also[key]] = kv
                    continue
                name = by_key.pop(key, None)
                if name is not None:
                    found[name] = kv
                if not by_key:
                    return found
            pending = list(by_key.values())
            if time.monotonic() >= deadline:
                return None

    def wait_deleted(self, name: str, timeout: float) -> bool:
        """True once `name` is absent (deleted, or its lease expired); False after `timeout` s."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            kv, revision = self._range(name)
            if kv is None:
                return True
            request = {"key": self._k(name), "start_revision": str(revision + 1), "filters": ["NOPUT"]}
            if any(event.get("type") == "DELETE" for event in self._watch(request, deadline)):
                return True
        return False

    def _watch(
        self, request: dict[str, Any], deadline: float, also: tuple[dict[str, Any], ...] = ()
    ) -> Generator[dict, None, None]:
        """The events of one watch (and of the watches `also`, on the same stream) until the deadline
        passes or the caller stops; a broken stream just ends: the caller reads again (which fails
        over, or reports the cluster gone)."""
        events = self.client.watch(request, deadline, also)
        try:
            yield from events
        except EtcdUnavailable:
            return
        except EtcdError as exc:
            raise StoreUnavailable(f"{self.describe} refused a watch: {exc}") from exc
        finally:
            events.close()  # closes the watch's connection at once

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
        self._call("/v3/kv/put", {"key": self._k(name), "value": self._seal(name, value), "lease": str(lease)})

    # ------------------------------------------------------------------ connections
    def connect_again(self) -> EtcdStore:
        """A second client with its own connection, for a thread that blocks in `wait`."""
        return EtcdStore(self.client.fork(), self.prefix, self.op_timeout, self.signer, self.progress)
