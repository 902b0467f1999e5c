"""Rendezvous at thousands of nodes: nothing on the critical path grows with N.

N nodes (threads, each with its own TCPStore connection) form one round on a real TCPStore,
every store call counted by node. On main the closer read each node descriptor with a `get` of
its own (N requests in a row) and every waiter, woken by the close, made four requests (check
and get of the round's record, check and get of its assignment). Now the closer reads them all
in one `multi_get`, and a woken waiter makes two: one read of the record its wait just saw (the
wait returns it: `wait_and_read`), one request for its assignment (or its absence).

bench.simrdzv measures the time at 1,024 and 4,096 nodes (docs/benchmarks.md).
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from collections.abc import Callable
from datetime import timedelta

import pytest

from rally.rendezvous.base.kv import UntrustedValue
from rally.rendezvous.base.token import Signer
from rally.rendezvous.c10d.store import Store, connect_tcp_store, host_tcp_store
from rally.rendezvous.etcd.client import EtcdClient, Member, b64
from rally.rendezvous.etcd.store import EtcdStore
from rally.rendezvous.protocol import NodeInfo, Rendezvous, RendezvousSettings
from support.etcd_cluster import etcd, etcd_cluster, losing_one_txn_reply, needs_etcd  # noqa: F401 - fixtures
from support.helpers import form_one_round_at_once

pytestmark = pytest.mark.timeout(60)
# Each TCPStore client reverse-resolves its peer: one short attempt where a resolver drops queries.
os.environ.setdefault("RES_OPTIONS", "timeout:1 attempts:1")
NODES = (8, 48)


@pytest.fixture(scope="module")
def server():
    store = host_tcp_store(0, 30, loopback_only=True)
    yield store
    del store


@pytest.fixture(scope="module")
def connections(server) -> list:
    """One connection per simulated node, opened once for every round these tests form."""
    return [connect_tcp_store("127.0.0.1", server.port, 30, 30) for _ in range(max(NODES))]


class CountingStore(Store):
    """A node's store connection that notes each call: (the torch method, the key, whether the call
    found / changed what it asked for), in order."""

    calls: list[tuple[str, str]]

    def _call(self, fn: Callable, *args):
        value = super()._call(fn, *args)
        key = args[0] if args and isinstance(args[0], str) else (args[0][0] if args and args[0] else "")
        self.calls.append((fn.__name__, key.removeprefix(self.prefix)))
        return value


def counting_store(server, raw, prefix: str, token: str = "") -> CountingStore:
    def reconnect():
        return connect_tcp_store("127.0.0.1", server.port, 30, 30)

    store = CountingStore(raw, prefix, "the test store", reconnect, Signer(token))
    store.calls = []
    return store


def form_round(server, connections: list, n: int) -> list[list[tuple[str, str]]]:
    """n nodes form one round at once; each node's calls, in order."""
    prefix = f"rally/{uuid.uuid4().hex}/"
    settings = RendezvousSettings(min_nodes=n, max_nodes=n, join_timeout=30, last_call_timeout=10)
    stores = [counting_store(server, raw, prefix) for raw in connections[:n]]
    nodes = [
        Rendezvous(store, settings, NodeInfo(node_id=f"node{i}:{i}", host=f"node{i}", addr="127.0.0.1", nproc=2))
        for i, store in enumerate(stores)
    ]
    form_one_round_at_once(nodes, 40)
    return [store.calls for store in stores]


def after_the_close(calls: list[tuple[str, str]]) -> list[str]:
    """A waiter's calls after its last wait for the round's record (which saw it)."""
    last = max(i for i, (method, key) in enumerate(calls) if method == "wait" and key == "0/closed")
    return [method for method, _ in calls[last + 1 :]]


@pytest.mark.timeout(120)
def test_the_closer_and_the_woken_waiters_make_as_many_calls_at_48_nodes_as_at_8(server, connections):
    by_size = {n: form_round(server, connections, n) for n in NODES}
    for n, nodes in by_size.items():
        (closer,) = [calls for calls in nodes if ("compare_set", "0/closed") in calls]
        reads = [method for method, key in closer if key.startswith("0/node/") and method != "compare_set"]
        assert reads == ["wait", "multi_get"], f"{n} nodes: the closer read the descriptors with {reads}"
        # its own assignment is the one it wrote: not read back
        assert [m for m, key in closer if key.startswith("0/assign/")] == ["multi_set"], closer
        waiters = [calls for calls in nodes if calls is not closer]
        assert all(after_the_close(calls) == ["multi_get", "compare_set"] for calls in waiters), (
            f"{n} nodes: after the close a waiter reads the record (the wait's one multi_get) and its assignment "
            "(one request): "
            f"{[after_the_close(calls) for calls in waiters][:3]}"
        )
    most = {n: max(len(calls) for calls in nodes) for n, nodes in by_size.items()}
    assert most[NODES[1]] <= most[NODES[0]], f"the busiest node's calls grew with N: {most}"
    assert most[NODES[0]] <= 14, f"{most[NODES[0]]} calls for the busiest of 8 nodes (main: 21, the closer's)"


def test_get_if_present_of_a_key_nobody_waits_for_is_one_request_that_creates_nothing(server, connections):
    prefix = f"rally/{uuid.uuid4().hex}/"
    store = counting_store(server, connections[0], prefix, token="secret")
    stranger = counting_store(server, connections[1], prefix, token="guess")
    store.set("mine", "value")
    stranger.set("forged", "value")
    store.calls.clear()
    assert store.get_if_present("mine", nobody_waits=True) == b"value"
    assert store.get_if_present("absent", nobody_waits=True) is None
    with pytest.raises(UntrustedValue, match="forged"):
        store.get_if_present("forged", nobody_waits=True)
    assert [method for method, _ in store.calls] == ["compare_set"] * 3, store.calls
    assert not store.check("absent"), "reading an absent key does not create it"


def test_get_if_present_of_a_key_somebody_waits_for_wakes_no_waiter(server, connections):
    """Torch's libuv server (the default) wakes a key's waiters on every compare_set, set
    or not, so the one-request read would end a wait for `closed` or `end` with the key still
    absent. By default `get_if_present` is a check and a get (two requests) and wakes nobody."""
    prefix = f"rally/{uuid.uuid4().hex}/"
    store = counting_store(server, connections[0], prefix)
    woken = threading.Event()

    def wait_for_closed() -> None:
        try:
            connections[2].wait([f"{prefix}0/closed"], timedelta(seconds=3))
        except Exception:  # the wait ran out: nobody woke it
            return
        woken.set()

    waiter = threading.Thread(target=wait_for_closed)
    waiter.start()
    time.sleep(0.3)  # the waiter is registered with the server
    assert store.get_if_present("0/closed") is None
    assert [method for method, _ in store.calls] == ["check"], store.calls
    assert not woken.wait(1.0), "reading a waited-for key that is absent woke its waiter"
    assert store.get_if_present("0/closed", nobody_waits=True) is None
    woke = woken.wait(1.0)
    waiter.join(5)
    # The reason for the two requests: if torch stops waking waiters on a compare_set that sets
    # nothing, every key can be read in one (then this line fails, and the flag can go).
    assert woke, "a compare_set that set nothing no longer wakes the key's waiters"


def test_read_each_is_one_multi_get_and_checks_every_value_on_its_own(server, connections):
    prefix = f"rally/{uuid.uuid4().hex}/"
    store = counting_store(server, connections[0], prefix, token="secret")
    stranger = counting_store(server, connections[1], prefix, token="guess")
    store.multi_set({f"0/node/{i}": f"descriptor {i}" for i in range(50) if i != 7})
    stranger.set("0/node/7", "forged")
    store.calls.clear()
    values = store.read_each([f"0/node/{i}" for i in range(50)])
    assert [method for method, _ in store.calls] == ["multi_get"], store.calls
    assert isinstance(values["0/node/7"], UntrustedValue), "a stranger's value is its own error"
    assert all(values[f"0/node/{i}"] == f"descriptor {i}".encode() for i in range(50) if i != 7)


@needs_etcd
def test_read_present_on_etcd_is_one_transaction(etcd):
    """The end records a joining node checks (the job's, the rounds' around the hint) cost one
    request on etcd, not one each."""
    members = [Member("127.0.0.1", m.client_port) for m in etcd.members]
    prefix = f"test/{uuid.uuid4().hex}/"
    requests = [0]

    class Counting(EtcdClient):
        def call(self, path, body, budget):
            requests[0] += 1
            return super().call(path, body, budget)

    store, writer = EtcdStore(Counting(members), prefix, 10), EtcdStore(EtcdClient(members), prefix, 10)
    writer.set("0/end", "the end")
    writer.client.call("/v3/kv/put", {"key": b64(prefix + "job/closed"), "value": b64("forged")}, 10)
    present = store.read_present(["job/closed", "0/end", "1/end"])
    assert requests[0] == 1, f"{requests[0]} requests for three keys"
    assert present["0/end"] == b"the end" and "1/end" not in present
    assert isinstance(present["job/closed"], UntrustedValue)


@needs_etcd
def test_a_first_wins_write_sent_again_after_a_lost_reply_still_wins(etcd):
    """Under load an etcd request can outlast the client's per-request timeout after etcd applied
    it; the client sends it again (etcd/client.py). A slot claim sent again finds its own value
    standing: it won (as on c10d). Before, the node took it for another's claim and claimed a
    second slot: at 4,096 simulated nodes one node held two slots and another was left out."""
    members = [Member("127.0.0.1", m.client_port) for m in etcd.members]
    LosesAReply = losing_one_txn_reply()  # the first transaction's reply is lost after etcd applied it

    prefix = f"test/{uuid.uuid4().hex}/"
    store, other = EtcdStore(LosesAReply(members), prefix, 10), EtcdStore(EtcdClient(members), prefix, 10)
    assert store.set_once("0/node/0", "this node") == (True, "this node")
    assert not LosesAReply.lost, "the reply was lost once and the transaction sent again"
    assert other.set_once("0/node/0", "another node") == (False, "this node")
